//@ ch21
// acme's c10d backend. Each collective is queued on the group's
// communication stream, after the work the caller's current stream has queued
// (the stream order is the collective's order, as with NCCL), so the compute
// stream goes on while a collective waits for the other ranks. Its Work
// carries an event recorded after it and a Future that completes on that
// stream, which is what DDP's reducer chains on. Work::wait()
// also blocks the host until the collective has run, so a failure (a rank
// gone, a timeout, ranks that disagree) is raised by the call that waits, as
// a torch.distributed.DistBackendError.
#include "aten/collectives.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <climits>
#include <functional>
#include <optional>
#include <thread>

#include "aten/acme_check.h"
#include "aten/launch.h"
#include "runtime/acme_comm.h"

namespace acme {
namespace {

constexpr const char* kCommIdKey = "acme_comm_id";  // in the group's own store

std::string name() { return c10::get_privateuse1_backend(); }

[[noreturn]] void raise(const std::string& what) {
  C10_THROW_ERROR(DistBackendError, c10::str(name(), " backend: ", what));
}

// How a tensor's elements travel: the runtime's type, and how many.
struct Elements {
  acmeDataType type;
  size_t count;
};

std::optional<acmeDataType> runtime_type(at::ScalarType t) {
  switch (t) {
    case at::kChar: return acmeInt8;
    case at::kByte:
    case at::kBool: return acmeUint8;
    case at::kInt: return acmeInt32;
    case at::kLong: return acmeInt64;
    case at::kHalf: return acmeFloat16;
    case at::kBFloat16: return acmeBfloat16;
    case at::kFloat: return acmeFloat32;
    case at::kDouble: return acmeFloat64;
    default: return std::nullopt;
  }
}

// Collectives that only move data take any dtype: the runtime's own type if
// it has one (its messages then name it), else the bytes.
Elements moved(const at::Tensor& t) {
  if (auto type = runtime_type(t.scalar_type())) return {*type, size_t(t.numel())};
  return {acmeUint8, size_t(t.nbytes())};
}

// The reductions c10d asks for, as the runtime's. Bool tensors reduce as
// bytes: sum is "any" (max), product "all" (min), as NCCL does.
acmeReduceOp runtime_op(const c10d::ReduceOp& op, at::ScalarType t) {
  const bool is_bool = t == at::kBool, floating = at::isFloatingType(t) || at::isComplexType(t);
  const char* op_names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR",
                            "PREMUL_SUM"};
  const char* op_name = op.op_ <= c10d::ReduceOp::PREMUL_SUM ? op_names[op.op_] : "UNUSED";
  if (at::isComplexType(t))
    TORCH_CHECK_VALUE(op.op_ == c10d::ReduceOp::SUM || op.op_ == c10d::ReduceOp::AVG ||
                          op.op_ == c10d::ReduceOp::PREMUL_SUM,
                      name(), " backend: ReduceOp.", op_name,
                      " is not defined for complex tensors (SUM, AVG and PREMUL_SUM are)");
  switch (op.op_) {
    case c10d::ReduceOp::PREMUL_SUM:
      TORCH_CHECK_VALUE(floating, name(), " backend: ReduceOp.PREMUL_SUM needs floating-point "
                        "tensors, not ", t);
      return acmeSum;
    case c10d::ReduceOp::SUM: return is_bool ? acmeMax : acmeSum;
    case c10d::ReduceOp::PRODUCT: return is_bool ? acmeMin : acmeProd;
    case c10d::ReduceOp::MIN: return acmeMin;
    case c10d::ReduceOp::MAX: return acmeMax;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_VALUE(floating, name(), " backend: ReduceOp.AVG needs floating-point tensors, not ",
                        t, " (use SUM and divide)");
      return acmeAvg;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK_VALUE(!floating, name(), " backend: ReduceOp.", op_name,
                        " needs integer or bool tensors, not ", t);
      return op.op_ == c10d::ReduceOp::BAND ? acmeBand
             : op.op_ == c10d::ReduceOp::BOR ? acmeBor
                                              : acmeBxor;
    default: break;
  }
  TORCH_CHECK_VALUE(false, name(), " backend: ReduceOp.", op_name, " is not supported");
}

// The elements a reduction works on: complex numbers as pairs of reals.
at::Tensor reducible(const at::Tensor& t) {
  if (at::isComplexType(t.scalar_type())) return at::view_as_real(t);
  TORCH_CHECK_VALUE(runtime_type(t.scalar_type()), name(), " backend: cannot reduce ",
                    t.scalar_type(), " tensors");
  return t;
}

// PREMUL_SUM multiplies each rank's input by a factor before the sum.
at::Tensor premultiplied(const at::Tensor& input, const c10d::ReduceOp& op) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return input;
  auto* factor = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK_VALUE(factor, name(), " backend: PREMUL_SUM without its factor");
  // The product keeps the input's dtype: the collective reduces that type.
  if (factor->tensor_factor.defined()) {
    TORCH_CHECK_VALUE(factor->tensor_factor.numel() == 1, name(),
                      " backend: PREMUL_SUM's factor must have one element");
    return (input * factor->tensor_factor.to(input.device()).reshape({})).to(input.scalar_type());
  }
  return (input * factor->double_factor).to(input.scalar_type());
}

// A handle on one queued collective.
class Work : public c10d::Work {
 public:
  Work(int rank, c10d::OpType type, const char* what, std::vector<at::Tensor> outputs,
       c10::Device device, acmeEvent_t done, acmeComm_t comm,
       c10::intrusive_ptr<c10d::Backend> owner)
      : c10d::Work(rank, type),
        what_(what),
        outputs_(std::move(outputs)),
        done_(done),
        comm_(comm),
        owner_(std::move(owner)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device})) {
    // Completes "on the stream": whoever waits on the future has their
    // current stream wait for this point, without blocking the host.
    future_->markCompleted(c10::IValue(outputs_));
  }
  ~Work() override { acmeEventDestroy(done_); }

  bool isCompleted() override {
    int complete = 1;
    return acmeEventQuery(done_, &complete) != acmeSuccess || complete;
  }
  bool isSuccess() const override { return acmeCommGetError(comm_) == acmeSuccess; }

  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout != ::kNoTimeout) {  // a deadline of the caller's own
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!isCompleted()) {
        if (std::chrono::steady_clock::now() > deadline)
          raise(c10::str(what_, " did not complete within ", timeout.count(), " ms"));
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    const acmeError_t e = acmeEventSynchronize(done_);
    if (e != acmeSuccess && acmeCommGetError(comm_) != acmeSuccess)
      raise(c10::str(what_, " failed: ", failure(comm_)));
    ACME_CHECK(e);  // a kernel before it failed: that error, as any wait reports it
    return true;
  }
  void synchronize() override { wait(::kNoTimeout); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  static std::string failure(acmeComm_t comm) {
    acmeCommGetError(comm);
    std::string message = acmeGetLastErrorMessage();
    const std::string prefix = "acmeCommGetError: the communicator failed earlier: ";
    return message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
  }

 private:
  const char* what_;
  std::vector<at::Tensor> outputs_;
  acmeEvent_t done_;
  acmeComm_t comm_;
  c10::intrusive_ptr<c10d::Backend> owner_;  // keeps comm_ alive as long as the Work
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class ProcessGroupAcme : public c10d::Backend {
 public:
  ProcessGroupAcme(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   std::chrono::milliseconds timeout)
      : c10d::Backend(rank, size), store_(std::move(store)), timeout_(timeout) {}
  ~ProcessGroupAcme() override {
    if (comm_) acmeCommDestroy(comm_);
  }

  const std::string getBackendName() const override { return name(); }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

//> ch21 split
  // torch.distributed.split_group asks each backend of the parent group for
  // a child over some of its ranks (parent ranks, in the child's order). A
  // rank outside them gets no backend. The child joins a communicator of its
  // own on first use, through its own store; NCCL's ncclCommSplit would reuse
  // the parent's connections instead, which the runtime has no call for.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    const auto me = std::find(ranks.begin(), ranks.end(), getRank());
    if (me == ranks.end()) return nullptr;
    // A clone: the child waits on its store while the parent may use its own.
    return c10::make_intrusive<ProcessGroupAcme>(store->clone(), int(me - ranks.begin()),
                                                 int(ranks.size()),
                                                 opts ? opts->timeout : timeout_);
  }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>(name(), timeout_);
  }
//< ch21 split

  // How many collectives this rank has queued in the group (sends and
  // receives, between two ranks only, are not counted). c10d's
  // TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper compares it across ranks with each
  // collective's shapes. Every rank starts at 0, so there is nothing to set
  // (2.13's default setter raises; from 2.14 it is a deprecated no-op).
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return collectives_; }

//> ch21 all-reduce
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                          const c10d::AllreduceOptions& opts) override {
    const at::Tensor& t = single(tensors, "all_reduce");
    const acmeReduceOp op = runtime_op(opts.reduceOp, t.scalar_type());
    return queue(c10d::OpType::ALLREDUCE, "all_reduce", t.device(), {t},
                 [&](acmeStream_t s) { return reduce_into(t, t, opts.reduceOp, op, s); });
  }
//< ch21 all-reduce

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                          const c10d::BroadcastOptions& opts) override {
    const at::Tensor& t = single(tensors, "broadcast");
    return queue(c10d::OpType::BROADCAST, "broadcast", t.device(), {t}, [&](acmeStream_t s) {
      const Elements e = moved(t);
      return acmeBroadcast(t.data_ptr(), e.count, e.type, int(opts.rootRank), comm_, s);
    });
  }

  // dist.reduce, dist.gather and dist.scatter, which the runtime has no
  // primitive for: an all_reduce, all_gather or broadcast whose result only
  // some ranks keep. They move n times the data a tree would; simple first.
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                       const c10d::ReduceOptions& opts) override {
    const at::Tensor& t = single(tensors, "reduce");
    const acmeReduceOp op = runtime_op(opts.reduceOp, t.scalar_type());
    const at::Tensor result = getRank() == opts.rootRank ? t : at::empty_like(t);
    return queue(c10d::OpType::REDUCE, "reduce", t.device(), {t},
                 [&](acmeStream_t s) { return reduce_into(result, t, opts.reduceOp, op, s); },
                 {}, {result});
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                       std::vector<at::Tensor>& inputs,
                                       const c10d::GatherOptions& opts) override {
    const at::Tensor& in = single(inputs, "gather");
    const bool root = getRank() == opts.rootRank;
    check_rank_list(outputs, /*rooted=*/true, root, in, "gather", "an output");
    at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
    return queue(
        c10d::OpType::GATHER, "gather", in.device(), root ? outputs[0] : std::vector<at::Tensor>{},
        [&](acmeStream_t s) { return gather_into(flat, in, s); },
        [&] {
          if (root) copy_out(flat, outputs[0]);
        },
        {in, flat});
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                        std::vector<std::vector<at::Tensor>>& inputs,
                                        const c10d::ScatterOptions& opts) override {
    const at::Tensor& out = single(outputs, "scatter");
    const bool root = getRank() == opts.rootRank;
    check_rank_list(inputs, /*rooted=*/true, root, out, "scatter", "an input");
    std::vector<at::Tensor> pieces;
    if (root)
      for (const at::Tensor& in : inputs[0]) pieces.push_back(in.reshape({-1}));
    at::Tensor flat = root ? at::cat(pieces) : at::empty({getSize() * out.numel()}, out.options());
    return queue(
        c10d::OpType::SCATTER, "scatter", out.device(), {out},
        [&](acmeStream_t s) {
          const Elements e = moved(flat);
          return acmeBroadcast(flat.data_ptr(), e.count, e.type, int(opts.rootRank), comm_, s);
        },
        [&] { out.copy_(flat.narrow(0, getRank() * out.numel(), out.numel()).view(out.sizes())); },
        {flat});
  }

  // dist.all_gather: gathers into one buffer, then copies out on the stream.
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions&) override {
    const at::Tensor& in = single(inputs, "all_gather");
    check_rank_list(outputs, /*rooted=*/false, true, in, "all_gather", "an output");
    at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
    return queue(
        c10d::OpType::ALLGATHER, "all_gather", in.device(), outputs[0],
        [&](acmeStream_t s) { return gather_into(flat, in, s); },
        [&] { copy_out(flat, outputs[0]); },  // on the same stream, after the gather
        {in, flat});
  }

  // dist.all_gather_into_tensor
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                const c10d::AllgatherOptions&) override {
    check_gather(out, in);
    return queue(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", in.device(), {out},
                 [&](acmeStream_t s) { return gather_into(out, in, s); }, {}, {in});
  }

  // FSDP2's all-gathers and reduce-scatters, several tensors at once: one
  // after the other on the stream, one Work for all of them.
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
      const c10d::AllgatherOptions&) override {
    TORCH_CHECK_VALUE(!ins.empty() && outs.size() == ins.size(), name(),
                      " backend: one output per input");
    for (size_t i = 0; i < ins.size(); ++i) check_gather(outs[i], ins[i]);
    return queue(c10d::OpType::COALESCED, "all_gather_into_tensor_coalesced", ins[0].device(),
                 outs, [&](acmeStream_t s) {
                   for (size_t i = 0; i < ins.size(); ++i)
                     if (acmeError_t e = gather_into(outs[i], ins[i], s)) return e;
                   return acmeSuccess;
                 }, {}, ins);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK_VALUE(!ins.empty() && outs.size() == ins.size(), name(),
                      " backend: one output per input");
    for (size_t i = 0; i < ins.size(); ++i) {
      check_scatter(outs[i], ins[i]);
      runtime_op(opts.reduceOp, ins[i].scalar_type());
      reducible(ins[i]);
    }
    return queue(c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED,
                 "reduce_scatter_tensor_coalesced", ins[0].device(), outs, [&](acmeStream_t s) {
                   for (size_t i = 0; i < ins.size(); ++i)
                     if (acmeError_t e = scatter_into(outs[i], ins[i], opts.reduceOp, s)) return e;
                   return acmeSuccess;
                 }, {}, ins);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    TORCH_CHECK_VALUE(!tensors.empty(), name(), " backend: all_reduce_coalesced of no tensors");
    std::vector<acmeReduceOp> ops;
    for (const at::Tensor& t : tensors) {  // all checked before any is queued
      check(t, "a tensor");
      ops.push_back(runtime_op(opts.reduceOp, t.scalar_type()));
      reducible(t);
    }
    return queue(c10d::OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", tensors[0].device(),
                 tensors, [&](acmeStream_t s) {
                   for (size_t i = 0; i < tensors.size(); ++i)
                     if (acmeError_t e = reduce_into(tensors[i], tensors[i], opts.reduceOp,
                                                     ops[i], s))
                       return e;
                   return acmeSuccess;
                 });
  }

  // dist.reduce_scatter_tensor
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& opts) override {
    check_scatter(out, in);
    runtime_op(opts.reduceOp, in.scalar_type());  // refuses what cannot reduce, here
    reducible(in);
    return queue(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", in.device(), {out},
                 [&](acmeStream_t s) { return scatter_into(out, in, opts.reduceOp, s); }, {},
                 {in});
  }

  // dist.all_to_all_single: rows of dim 0, split evenly or as the sizes say.
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                              std::vector<int64_t>& out_splits,
                                              std::vector<int64_t>& in_splits,
                                              const c10d::AllToAllOptions&) override {
    check(in, "the input");
    check(out, "the output");
    TORCH_CHECK_VALUE(out.dtype() == in.dtype(), name(), " backend: all_to_all_single needs one dtype");
    const int n = getSize();
    auto layout = [&](const at::Tensor& t, std::vector<int64_t> splits, const char* what,
                      std::vector<size_t>& counts, std::vector<size_t>& offsets) {
      const int64_t rows = t.dim() ? t.size(0) : 1, row = rows ? t.numel() / rows : 0;
      if (splits.empty()) {
        TORCH_CHECK_VALUE(rows % n == 0, name(), " backend: all_to_all_single: the ", what,
                          "'s ", rows, " rows do not split evenly among ", n, " ranks");
        splits.assign(n, rows / n);
      }
      TORCH_CHECK_VALUE(int(splits.size()) == n, name(), " backend: all_to_all_single: ", what,
                        " split sizes need one entry per rank (", n, ")");
      size_t at = 0;
      for (int64_t rows_r : splits) {
        TORCH_CHECK_VALUE(rows_r >= 0, name(), " backend: negative split size");
        offsets.push_back(at);
        counts.push_back(size_t(rows_r * row));
        at += size_t(rows_r * row);
      }
      TORCH_CHECK_VALUE(at == size_t(t.numel()), name(), " backend: all_to_all_single: the ",
                        what, " split sizes cover ", at / std::max<int64_t>(row, 1),
                        " rows, the tensor has ", rows);
    };
    std::vector<size_t> send_counts, send_offsets, recv_counts, recv_offsets;
    layout(in, in_splits, "input", send_counts, send_offsets);
    layout(out, out_splits, "output", recv_counts, recv_offsets);
    return queue(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", in.device(), {out},
                 [&](acmeStream_t s) {
                   const Elements e = moved(in);
                   if (!runtime_type(in.scalar_type()))  // moved as bytes: so are the counts
                     for (auto* v : {&send_counts, &send_offsets, &recv_counts, &recv_offsets})
                       for (size_t& x : *v) x *= in.element_size();
                   return acmeAllToAll(in.data_ptr(), send_counts.data(), send_offsets.data(),
                                       out.data_ptr(), recv_counts.data(), recv_offsets.data(),
                                       e.type, comm_, s);
                 }, {}, {in});
  }

  // Tags are not matched: a rank's sends to a peer pair with that peer's
  // receives in order, as with NCCL.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int) override {
    const at::Tensor& t = single(tensors, "send");
    return queue(c10d::OpType::SEND, "send", t.device(), {t}, [&](acmeStream_t s) {
      const Elements e = moved(t);
      return acmeSend(t.data_ptr(), e.count, e.type, dst, comm_, s);
    });
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int) override {
    const at::Tensor& t = single(tensors, "recv");
    return queue(c10d::OpType::RECV, "recv", t.device(), {t}, [&](acmeStream_t s) {
      const Elements e = moved(t);
      return acmeRecv(t.data_ptr(), e.count, e.type, src, comm_, s);
    });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    const c10::Device device =
        device_ ? *device_
                : c10::Device(c10::DeviceType::PrivateUse1, c10::impl::getDeviceGuardImpl(
                                                                c10::DeviceType::PrivateUse1)
                                                                ->getDevice()
                                                                .index());
    return queue(c10d::OpType::BARRIER, "barrier", device, {},
                 [&](acmeStream_t s) { return acmeCommBarrier(comm_, s); });
  }

 private:
  // The lists of one tensor per rank: all_gather's outputs on every rank,
  // gather's and scatter's on the root only (`here`), each like `like`.
  void check_rank_list(const std::vector<std::vector<at::Tensor>>& lists, bool rooted, bool here,
                       const at::Tensor& like, const char* op, const char* what) {
    TORCH_CHECK_VALUE(here ? lists.size() == 1 && int(lists[0].size()) == getSize()
                           : lists.empty() || lists[0].empty(),
                      name(), " backend: ", op, " needs a list of ", getSize(), " tensors",
                      rooted ? " on the root, none elsewhere" : "");
    if (!here) return;
    for (const at::Tensor& t : lists[0]) {
      check(t, what);
      TORCH_CHECK_VALUE(t.sizes() == like.sizes() && t.dtype() == like.dtype(), name(),
                        " backend: ", op, ": ", what, " of ", t.sizes(), " ", t.dtype(),
                        " does not match ", like.sizes(), " ", like.dtype());
    }
  }

  // One rank's block of a gathered buffer into each tensor of the list.
  void copy_out(const at::Tensor& flat, const std::vector<at::Tensor>& outs) {
    const int64_t n = outs[0].numel();
    for (int r = 0; r < getSize(); ++r)
      outs[r].copy_(flat.narrow(0, r * n, n).view(outs[r].sizes()));
  }

//> ch21 reduce-into
  // out = the reduction of every rank's `in` (which may be out itself).
  acmeError_t reduce_into(const at::Tensor& out, const at::Tensor& in, const c10d::ReduceOp& op,
                          acmeReduceOp runtime, acmeStream_t s) {
    const at::Tensor o = reducible(out), i = reducible(premultiplied(in, op));
    return acmeAllReduce(i.data_ptr(), o.data_ptr(), o.numel(), *runtime_type(o.scalar_type()),
                         runtime, comm_, s);
  }
//< ch21 reduce-into

  void check_gather(const at::Tensor& out, const at::Tensor& in) {
    check(in, "the input");
    check(out, "the output");
    TORCH_CHECK_VALUE(out.numel() == in.numel() * getSize() && out.dtype() == in.dtype(), name(),
                      " backend: all_gather_into_tensor needs an output of ", getSize(),
                      " x ", in.numel(), " elements of ", in.dtype(), ", got ", out.numel(),
                      " of ", out.dtype());
  }

  void check_scatter(const at::Tensor& out, const at::Tensor& in) {
    check(in, "the input");
    check(out, "the output");
    TORCH_CHECK_VALUE(in.numel() == out.numel() * getSize() && out.dtype() == in.dtype(), name(),
                      " backend: reduce_scatter_tensor needs an input of ", getSize(), " x ",
                      out.numel(), " elements of ", out.dtype(), ", got ", in.numel(), " of ",
                      in.dtype());
  }

  acmeError_t gather_into(const at::Tensor& out, const at::Tensor& in, acmeStream_t s) {
    const Elements e = moved(in);
    return acmeAllGather(in.data_ptr(), out.data_ptr(), e.count, e.type, comm_, s);
  }

  acmeError_t scatter_into(const at::Tensor& out, const at::Tensor& in,
                           const c10d::ReduceOp& op, acmeStream_t s) {
    const at::Tensor o = reducible(out), i = reducible(premultiplied(in, op));
    return acmeReduceScatter(i.data_ptr(), o.data_ptr(), o.numel(), *runtime_type(o.scalar_type()),
                             runtime_op(op, in.scalar_type()), comm_, s);
  }

  // One tensor per process and call, on this group's device.
  const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* what) {
    TORCH_CHECK_VALUE(tensors.size() == 1, name(), " backend: ", what,
                      " takes one tensor per process, got ", tensors.size());
    check(tensors[0], "the tensor");
    return tensors[0];
  }

  void check(const at::Tensor& t, const char* what) {
    TORCH_CHECK_VALUE(t.device().type() == c10::DeviceType::PrivateUse1, name(), " backend: ",
                      what, " is on ", t.device(), "; this backend moves ", name(),
                      " tensors (init_process_group(\"cpu:gloo,", name(), ":", name(),
                      "\") gives CPU tensors gloo)");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided && t.is_contiguous(), name(), " backend: ",
                      what, " must be a contiguous dense tensor");
    if (!device_) device_ = t.device();  // the first collective binds the rank to a device
    TORCH_CHECK_VALUE(t.device() == *device_, name(), " backend: ", what, " is on ", t.device(),
                      ", but rank ", getRank(), " of this group uses ", *device_,
                      " (one device per rank: call torch.", name(),
                      ".set_device(rank) before the first collective)");
  }

  // Joins the communicator on first use: rank 0 makes its id and posts it in
  // the group's store, the others read it there.
  void connect() {
    if (comm_) return;
    acmeCommId id;
    try {
      if (getRank() == 0) {
        ACME_CHECK(acmeCommGetUniqueId(&id));
        store_->set(kCommIdKey, std::vector<uint8_t>(id.name, id.name + sizeof id.name));
      } else {
        store_->wait({kCommIdKey}, timeout_);
        const std::vector<uint8_t> got = store_->get(kCommIdKey);
        TORCH_CHECK(got.size() == sizeof id.name, "malformed communicator id");
        std::copy(got.begin(), got.end(), id.name);
      }
    } catch (const c10::DistError& e) {
      raise(c10::str("rank ", getRank(), " could not get the communicator's id from rank 0: ",
                     e.what_without_backtrace()));
    }
    // The runtime takes milliseconds as an unsigned int, 0 meaning "none".
    const auto ms = std::clamp<int64_t>(timeout_.count(), 1, UINT_MAX);
    const acmeError_t e = acmeCommInitRank(&comm_, getSize(), id, getRank(), unsigned(ms));
    if (e == acmeErrorCommFailure) raise(acmeGetLastErrorMessage());
    ACME_CHECK(e);
  }

//> ch21 queue
  // Queues one collective on this group's communication stream, after what
  // the caller's current stream has queued so far, and records the event its
  // Work waits for. `uses` are the tensors it reads or writes besides the
  // outputs (inputs, staging buffers): their memory is not reused before the
  // communication stream is done with it. `then` queues what finishes the
  // results (copies out of a staging buffer) before the event, so waiting for
  // the Work covers it.
  template <class Call>
  c10::intrusive_ptr<c10d::Work> queue(c10d::OpType type, const char* what, c10::Device device,
                                       std::vector<at::Tensor> outputs, Call call,
                                       const std::function<void()>& then = {},
                                       const std::vector<at::Tensor>& uses = {}) {
    c10::DeviceGuard guard(device);
    connect();
    if (type != c10d::OpType::SEND && type != c10d::OpType::RECV) ++collectives_;
    const c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream compute = impl.getStream(device);
    if (!comm_stream_) comm_stream_ = impl.getStreamFromGlobalPool(device, true);
    const c10::Stream comm = *comm_stream_;
    c10::Event ready(device.type());
    ready.record(compute);
    ready.block(comm);  // the collective sees everything queued before it
    for (const auto& list : {std::cref(outputs), std::cref(uses)})
      for (const at::Tensor& t : list.get())
        if (t.defined() && t.storage().data_ptr().get())
          impl.recordDataPtrOnStream(t.storage().data_ptr(), comm);
    // Temporaries the call and `then` allocate belong to the comm stream, and
    // the Work's future completes there.
    const c10::StreamGuard on_comm(comm);
    const acmeStream_t stream = current_stream(device.index());
    const acmeError_t e = call(stream);
    if (e == acmeErrorCommFailure) raise(c10::str(what, " failed: ", Work::failure(comm_)));
    ACME_CHECK(e);
    if (then) then();
    acmeEvent_t done;
    ACME_CHECK(acmeEventCreate(&done, device.index(), acmeEventDefault));
    ACME_CHECK(acmeEventRecord(done, stream));
    return c10::make_intrusive<Work>(
        getRank(), type, what, std::move(outputs), device, done, comm_,
        c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(this));
  }
//< ch21 queue

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  acmeComm_t comm_ = nullptr;
  std::optional<c10::Device> device_;
  std::optional<c10::Stream> comm_stream_;  // where this group's collectives run
  uint64_t collectives_ = 0;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_process_group_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout) {
  return c10::make_intrusive<ProcessGroupAcme>(store, rank, size, timeout);
}

}  // namespace acme
