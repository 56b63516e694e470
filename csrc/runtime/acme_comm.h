//@ ch21
/* The acme runtime, chapter 21: the collective communication library, as
 * NCCL's header stands beside CUDA's. A header apart from acme_runtime.h: code
 * that moves no data between ranks does not include it.
 *
 * Configuration, read from the environment by the first collective:
 *   ACME_COMM_DEBUG     1: every collective writes what it moves where to
 *                       stderr, one line per step and rank (default 0) */
#ifndef ACME_COMM_H_
#define ACME_COMM_H_

#include "runtime/acme_streams.h"

#ifdef __cplusplus
extern "C" {
#endif

//> ch21 collectives-api
/* ---- collective communication ----
 *
 * What NCCL is to CUDA: ranks in different processes, one device each, move
 * and reduce device memory together. A communicator joins `nranks` processes
 * of one machine; acme's transport is a shared-memory segment they all map.
 *
 * Every collective is queued on a stream like a kernel (its trace name is the
 * function's) and runs when the stream reaches it: it waits there for the
 * other ranks. All ranks must call the same collectives in the same order
 * with matching sizes, types and roots; a communicator's calls run in the
 * order they were queued, whatever their streams. A collective that fails (a
 * rank disagrees, exits, or does not arrive within the communicator's
 * timeout) fails as a kernel does (acmeErrorLaunchFailure at the next
 * synchronizing call, its message naming the collective and the rank), and
 * marks the communicator failed on every rank: later calls return
 * acmeErrorCommFailure with the first failure's message. */

typedef struct acmeComm_st* acmeComm_t;
/* Names one communicator: rank 0 makes it, the others receive it (through
 * any channel, e.g. PyTorch's c10d store) before acmeCommInitRank. */
typedef struct acmeCommId { char name[64]; } acmeCommId;

typedef enum acmeDataType {
  acmeInt8 = 0, acmeUint8 = 1, acmeInt32 = 2, acmeInt64 = 3,
  acmeFloat16 = 4, acmeBfloat16 = 5, acmeFloat32 = 6, acmeFloat64 = 7
} acmeDataType;

/* acmeAvg is the sum divided by nranks (floating types only); the bitwise
 * ops take integer types only. */
typedef enum acmeReduceOp {
  acmeSum = 0, acmeProd = 1, acmeMin = 2, acmeMax = 3, acmeAvg = 4,
  acmeBand = 5, acmeBor = 6, acmeBxor = 7
} acmeReduceOp;

/* A fresh id; call on one rank only. */
ACME_API acmeError_t acmeCommGetUniqueId(acmeCommId* id);
/* Joins communicator `id` as `rank` of `nranks` (at most 64); returns when
 * all ranks have joined, or fails with acmeErrorCommFailure after timeoutMs.
 * timeoutMs (0: none) also bounds how long any collective waits for the
 * others. */
ACME_API acmeError_t acmeCommInitRank(acmeComm_t* comm, int nranks, acmeCommId id, int rank,
                                      unsigned timeoutMs);
/* Releases the handle. Collectives already queued still run (they keep the
 * segment mapped until then); the handle must not be used again. */
ACME_API acmeError_t acmeCommDestroy(acmeComm_t comm);
/* acmeSuccess while usable; else acmeErrorCommFailure, with the message. */
ACME_API acmeError_t acmeCommGetError(acmeComm_t comm);

/* Buffers are device pointers; counts are elements. All-reduce, broadcast
 * and reduce-scatter's own block may be in place (send == recv). */
ACME_API acmeError_t acmeAllReduce(const void* send, void* recv, size_t count, acmeDataType type,
                                   acmeReduceOp op, acmeComm_t comm, acmeStream_t stream);
ACME_API acmeError_t acmeBroadcast(void* buffer, size_t count, acmeDataType type, int root,
                                   acmeComm_t comm, acmeStream_t stream);
/* recv holds nranks * sendCount elements, rank r's at r * sendCount. */
ACME_API acmeError_t acmeAllGather(const void* send, void* recv, size_t sendCount,
                                   acmeDataType type, acmeComm_t comm, acmeStream_t stream);
/* send holds nranks * recvCount elements; rank r receives block r reduced. */
ACME_API acmeError_t acmeReduceScatter(const void* send, void* recv, size_t recvCount,
                                       acmeDataType type, acmeReduceOp op, acmeComm_t comm,
                                       acmeStream_t stream);
/* Each rank sends sendCounts[r] elements from send + sendOffsets[r] to rank r,
 * and receives recvCounts[r] elements from rank r at recv + recvOffsets[r]
 * (arrays of nranks). Rank a's sendCounts[b] must equal rank b's
 * recvCounts[a]. send and recv must not overlap. */
ACME_API acmeError_t acmeAllToAll(const void* send, const size_t* sendCounts,
                                  const size_t* sendOffsets, void* recv,
                                  const size_t* recvCounts, const size_t* recvOffsets,
                                  acmeDataType type, acmeComm_t comm, acmeStream_t stream);
/* Point to point: a send to `peer` pairs with that peer's recv from this
 * rank, in order; count and type must match. */
ACME_API acmeError_t acmeSend(const void* send, size_t count, acmeDataType type, int peer,
                              acmeComm_t comm, acmeStream_t stream);
ACME_API acmeError_t acmeRecv(void* recv, size_t count, acmeDataType type, int peer,
                              acmeComm_t comm, acmeStream_t stream);
/* Returns on the stream once every rank's stream has reached its barrier. */
ACME_API acmeError_t acmeCommBarrier(acmeComm_t comm, acmeStream_t stream);
//< ch21 collectives-api

#ifdef __cplusplus
}
#endif

#endif /* ACME_COMM_H_ */
