#@ ch20
"""torch.compile's code generator, Inductor, for acme (chapter 20).

Imported, and registered with Inductor, when torch._inductor.compile_fx loads
(compiler_hooks.py): the first torch.compile of a process.

acme's "device" is the host's CPU, so its kernels are what Inductor writes for
the CPU: C++ with OpenMP, compiled by the host compiler. What is acme's own is
how they run: each kernel gets an entry point that takes its arguments as one
array, and every call goes through the runtime (csrc/aten/compiled_kernels.cpp)
onto the current stream, with the device-side addresses of its tensors.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import re
import threading
import warnings

import torch
import torch._inductor.compile_fx as compile_fx_module
from torch._inductor import config
from torch._inductor.codegen.common import (
    DeviceOpOverrides,
    register_backend_for_device,
    register_device_op_overrides,
)
from torch._inductor.codegen.cpp import CppScheduling
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
from torch._inductor.custom_graph_pass import CustomGraphModulePass
from torch._inductor.virtualized import V

from . import DEVICE_NAME, inductor_config
from .dynamo import AcmeInterface
from ._C import _launch_compiled
#> ch23 graph-flag-import
from ._C import _set_in_compiled_graph
#< ch23 graph-flag-import

# ---- running a compiled kernel ----


#> ch20 compiled-kernel
class CompiledKernel:
    """One kernel Inductor generated, as the wrapper code calls it: with the
    graph's tensors and sizes, in the kernel's argument order."""

    def __init__(self, name: str, signature: str, library):
        self.name = name
        self.signature = signature  # 'p' a tensor, 'i' an int, per argument
        self._library = library  # the compiled `kernel`, or a future of it
        self._entry = None

    def __call__(self, *args) -> None:
        if self._entry is None:  # the first call waits for the compiler
            library = self._library
            function = library.result() if hasattr(library, "result") else library
            self._entry = ctypes.cast(function, ctypes.c_void_p).value
        _launch_compiled(self.name, self._entry, self.signature, args)
#< ch20 compiled-kernel


#> ch23 graph-call
def graph_call(call):
    """A compiled graph's `call`, run with the device's full thread count for
    every kernel it launches (csrc/aten/kernel_threads.h): Inductor sized its
    own kernels for that count, and the graph's matrix multiplies need it."""

    def run(args):
        before = _set_in_compiled_graph(True)
        try:
            return call(args)
        finally:
            _set_in_compiled_graph(before)

    return run
#< ch23 graph-call


# ---- turning Inductor's C++ kernel into an acme kernel ----

# What Inductor's C++ scheduling writes for one kernel: the argument types, and
# the source of `extern "C" void kernel(...)` over raw pointers and sizes.
_CPU_DEFINITION = re.compile(r"async_compile\.cpp_pybinding\((\[.*?\]), r'''\n(.*)\n'''\)\s*$",
                             re.DOTALL)
_KERNEL_DECLARATION = re.compile(r'extern "C"\s+void\s+kernel\(')


def _argument(index: int, cpp_type: str) -> tuple[str, str]:
    """(signature letter, C++ expression) for argument `index` of type `cpp_type`."""
    if cpp_type.endswith("*"):
        return "p", f"reinterpret_cast<{cpp_type}>(a[{index}])"
    if cpp_type in ("const int64_t", "int64_t"):
        return "i", f"static_cast<int64_t>(a[{index}])"
    raise NotImplementedError(
        f"{DEVICE_NAME}: torch.compile generated a kernel with an argument of type "
        f"'{cpp_type}', which {DEVICE_NAME}'s kernel launcher does not pass "
        "(it passes pointers and int64 sizes)")


#> ch20 kernel-source
def acme_kernel_source(name: str, cpu_definition: str) -> tuple[str, str]:
    """The signature and C++ source of the acme kernel for Inductor's CPU
    kernel `name`: Inductor's function, renamed, behind an entry point
    `kernel(const uint64_t* a)` that unpacks the argument array."""
    match = _CPU_DEFINITION.match(cpu_definition.strip())
    if match is None or len(_KERNEL_DECLARATION.findall(match.group(2))) != 1:
        raise NotImplementedError(
            f"{DEVICE_NAME}: kernel {name} is not in the form {DEVICE_NAME}'s Inductor "
            "backend expects from PyTorch's C++ code generation")
    argument_types = ast.literal_eval(match.group(1))
    letters, expressions = zip(*(_argument(i, t) for i, t in enumerate(argument_types)))
    body = _KERNEL_DECLARATION.sub(f'static void {name}(', match.group(2))
    entry = (f'extern "C" void kernel(const uint64_t* a) {{\n'
             f'    {name}({", ".join(expressions)});\n}}\n')
    return "".join(letters), f"{body}\n\n{entry}"
#< ch20 kernel-source


#> ch20 scheduling
class AcmeScheduling(CppScheduling):
    """Inductor's C++ scheduling, for acme nodes (Inductor makes one scheduling
    per device type). Inductor names kernels by their source, graph-wide, so
    a CPU kernel and an acme kernel with the same source would share one name
    and one way of being called: mark acme's sources as acme's."""

    def define_kernel(self, src_code, nodes, kernel_args=None):
        return super().define_kernel(f"// {DEVICE_NAME} kernel\n{src_code}", nodes, kernel_args)
#< ch20 scheduling


# ---- the wrapper: the Python code that allocates buffers and calls kernels ----


#> ch20 wrapper-kernels
class _AcmeKernels:
    """What acme's wrapper code does differently from the CPU's: define and
    call kernels through CompiledKernel. Kernels of other devices in the same
    graph (a CPU scalar, say) keep their usual form."""

    def write_header(self) -> None:
        super().write_header()
        self.imports.writeline(f"from {__name__} import CompiledKernel")
#> ch23 graph-call-import
        self.imports.writeline(f"from {__name__} import graph_call as _acme_graph_call")
#< ch23 graph-call-import

    def define_kernel(self, kernel_name, kernel_body, metadata=None, gpu=True,
                      cpp_definition=None):
        device = V.graph.get_current_device_or_throw()
        if device.type == DEVICE_NAME:
            signature, source = acme_kernel_source(kernel_name, kernel_body)
            kernel_body = (f"CompiledKernel({kernel_name!r}, {signature!r}, "
                           f"async_compile.cpp(r'''\n{source}'''))")
        super().define_kernel(kernel_name, kernel_body, metadata, gpu, cpp_definition)

    def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None, triton=True,
                                     **kwargs):
        device = device or V.graph.get_current_device_or_throw()
        if device.type == DEVICE_NAME and not triton:
            self.writeline(self.wrap_kernel_call(kernel_name, call_args))
            return
        super()._generate_kernel_call_helper(kernel_name, call_args, device=device,
                                             triton=triton, **kwargs)

    def make_allocation(self, name, device, dtype, shape, stride, allocation_shape=None,
                        is_pinned=False):
        # Inductor writes device='acme' and counts on a device guard around the
        # code to pick the index, a guard it writes for GPUs only. Name the
        # index, or a graph on acme:1 would allocate on the current device.
        line = super().make_allocation(name, device, dtype, shape, stride, allocation_shape,
                                       is_pinned)
        if device.type == DEVICE_NAME and device.index is not None:
            line = line.replace(f"device='{device.type}'", f"device='{device}'")
        return line
#< ch20 wrapper-kernels


class AcmeWrapperCodegen(_AcmeKernels, PythonWrapperCodegen):
    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        if is_subgraph:
            return AcmeSubgraphWrapperCodegen(subgraph_name, parent_wrapper, partition_signatures)
        return AcmeWrapperCodegen()
#> ch23 graph-call-wrap

    def generate_after_suffix(self, result) -> None:
        super().generate_after_suffix(result)
        # What Inductor calls is the module's `call`: wrapped, the graph runs
        # its kernels on the device's full thread count (graph_call).
        result.writeline("call = _acme_graph_call(call)")
#< ch23 graph-call-wrap


class AcmeSubgraphWrapperCodegen(_AcmeKernels, SubgraphPythonWrapperCodegen):
    def write_header(self) -> None:
        pass  # a subgraph's code goes inside its parent's module, after its header


def _unsupported(what: str):
    class Unsupported:
        supports_caching = False

        @staticmethod
        def create(*args, **kwargs):
            raise NotImplementedError(f"{DEVICE_NAME}: torch.compile with {what} is not "
                                      f"supported on {DEVICE_NAME}; use the default Python "
                                      "wrapper")
    return Unsupported


# The C++ wrapper (config.cpp_wrapper, AOTInductor) and the FX wrapper need
# their own classes, which acme does not have; Inductor wants a name for each.
AcmeCppWrapperCodegen = _unsupported("the C++ wrapper (cpp_wrapper, AOTInductor)")
AcmeFxWrapperCodegen = _unsupported("the FX wrapper (fx_wrapper)")


# ---- the few lines of device code the wrapper writes ----


class AcmeDeviceOpOverrides(DeviceOpOverrides):
    def import_get_raw_stream_as(self, name: str) -> str:
        # The device interface's (dynamo.py), as Inductor's GPU wrappers use theirs.
        return f"from {AcmeInterface.__module__} import AcmeInterface\n" \
               f"{name} = AcmeInterface.get_raw_stream"

    def set_device(self, device_idx: int) -> str:
        return f"torch.{DEVICE_NAME}.set_device({device_idx})"

    def synchronize(self) -> str:
        return f"torch.{DEVICE_NAME}.synchronize()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.{DEVICE_NAME}.device({device_idx})"


# ---- Inductor's settings for graphs on acme ----
# Inductor (2.13 to 2.15) tells its C++ code generator from the others by asking whether
# the device type is "cpu", in many places. acme uses that generator under
# another name, so its graphs compile with the settings that make those places
# answer as they do for the CPU (chapter 20 lists them; pytorch#189137 is the
# upstream plan to replace them with registrations).
#> ch20 settings
ACME_SETTINGS = {
    # Which generator a device's kernels come from: cpu_backend for "cpu",
    # cuda_backend for every device type Inductor does not know.
    "cuda_backend": "cpp",
    # Loop reordering across fusions: built for the GPU generators, skipped
    # for "cpu" nodes (scheduler.py), never tried on C++ kernels.
    "loop_ordering_after_fusion": False,
    "loop_reindexing_after_fusion": False,
    "loop_index_inversion_in_fusion": False,
    # Random numbers drawn by acme's generator, as eager draws them, rather
    # than by Inductor's own Philox code: compiled dropout matches eager.
    "fallback_random": True,
}
#< ch20 settings


def _on_acme(graph, example_inputs) -> bool:
    def is_acme(value) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == DEVICE_NAME

    # Dynamo's graphs keep a node's fake value as "example_value", later ones as "val".
    return (any(is_acme(x) for x in example_inputs)
            or any(is_acme(node.meta.get("val", node.meta.get("example_value")))
                   for node in graph.graph.nodes))


def _uses_streams(graph) -> bool:
    return any(node.op == "call_function" and str(node.target).startswith("streams.")
               for node in graph.graph.nodes)


_compile_fx = compile_fx_module.compile_fx
_inside = threading.local()  # compile_fx calls itself once it has applied its patches


#> ch20 compile-fx
@functools.wraps(_compile_fx)
def compile_fx(model, example_inputs, *args, config_patches=None, **kwargs):
    """Inductor's entry point, applying ACME_SETTINGS to graphs on acme (to
    their backward too: compile_fx hands the patches to the later compile)."""
    if not getattr(_inside, "patched", False) and _on_acme(model, example_inputs):
        if _uses_streams(model):
            # Dynamo records streams, events and synchronize in the graph, but
            # Inductor (2.13 to 2.15) writes the code that switches streams for
            # GPUs only (device_need_guard): acme kernels would name undefined streams or
            # run before work they must follow. Run such graphs as AOTAutograd
            # traced them, without Inductor's kernels.
            warnings.warn(f"{DEVICE_NAME}: a compiled graph uses streams, events or "
                          f"synchronize, which Inductor cannot generate {DEVICE_NAME} code "
                          "for; it runs without Inductor's kernels (as backend='aot_eager')",
                          stacklevel=2)
            return torch._dynamo.lookup_backend("aot_eager")(model, example_inputs)
        # The user's own patches (torch.compile's options) win over acme's.
        _inside.patched = True
        try:
            return _compile_fx(model, example_inputs, *args,
                               config_patches={**ACME_SETTINGS, **(config_patches or {})},
                               **kwargs)
        finally:
            _inside.patched = False
    return _compile_fx(model, example_inputs, *args, config_patches=config_patches, **kwargs)


# torch.compile's inductor backend looks compile_fx up when it compiles.
compile_fx_module.compile_fx = compile_fx
#< ch20 compile-fx


# ---- a graph pass for acme graphs ----


class AcmeGraphPass(CustomGraphModulePass):
    """Rewrites two patterns Inductor 2.13 handles for "cpu" and GPUs only.
    Inductor runs this pass on every graph with acme tensors, after its own
    post-grad passes."""

    def __call__(self, graph_module: torch.fx.GraphModule) -> None:
        graph = graph_module.graph
        for node in list(graph.nodes):
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                self.move_cpu_scalars(graph, node)
                self.flatten_arg_reductions(graph, node)  # may replace the node: last
        graph.lint()
        graph_module.recompile()

#> ch20 move-cpu-scalars
    @staticmethod
    def move_cpu_scalars(graph, node) -> None:
        """A 0-d CPU tensor beside acme tensors (``torch.tensor(2.) * x``) is a
        scalar to eager. Inductor copies it to a GPU; for other devices it
        builds the kernel on the CPU, which would read acme memory through the
        host mapping. Copy it to acme."""
        result = node.meta.get("val")
        if not isinstance(result, torch.Tensor) or result.device.type != DEVICE_NAME:
            return  # only ops whose result is on acme: not copies to the host, say
        values = {arg: arg.meta.get("val") for arg in node.all_input_nodes}
        device = result.device
        for arg, value in values.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0:
                with graph.inserting_before(node):
                    copy = graph.call_function(torch.ops.prims.device_put.default, (arg, device))
                with value.fake_mode:
                    copy.meta["val"] = value.to(device)
                node.replace_input_with(arg, copy)
#< ch20 move-cpu-scalars


    @staticmethod
    def flatten_arg_reductions(graph, node) -> None:
        """argmax/argmin over all dimensions count positions in logical
        (row-major) order. Over several dimensions, Inductor's C++ kernels
        count in memory order, and Inductor corrects that for "cpu" and Triton
        only: on a transposed input the index would silently be wrong. Reduce
        over one dimension, a flattened contiguous copy, instead."""
        if node.target not in (torch.ops.aten.argmax.default, torch.ops.aten.argmin.default):
            return
        source = node.args[0]
        value = source.meta.get("val")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if dim is not None or not isinstance(value, torch.Tensor) or value.dim() < 2:
            return
        if value.device.type != DEVICE_NAME:
            return
        with graph.inserting_before(node):
            copy = graph.call_function(torch.ops.aten.clone.default, (source,),
                                       {"memory_format": torch.contiguous_format})
            flat = graph.call_function(torch.ops.aten.view.default, (copy, [-1]))
            reduced = graph.call_function(node.target, (flat, 0))
            shaped = reduced
            if keepdim:  # the index, shaped [1] * rank as the original returns it
                shaped = graph.call_function(torch.ops.aten.view.default,
                                             (reduced, [1] * value.dim()))
        with value.fake_mode:
            copy.meta["val"] = value.clone(memory_format=torch.contiguous_format)
            flat.meta["val"] = copy.meta["val"].view(-1)
            reduced.meta["val"] = node.target(flat.meta["val"], 0)
            shaped.meta["val"] = reduced.meta["val"].view([1] * value.dim()) if keepdim \
                else reduced.meta["val"]
        node.replace_all_uses_with(shaped)
        graph.erase_node(node)

    def uuid(self) -> str:
        return inductor_config.code_version


# ---- registration ----
#> ch20 registration
# The scheduling, which decides what to fuse and writes the kernels, is the
# CPU's (marked); the wrapper code is acme's. Inductor's caches key on inductor_config.
register_backend_for_device(DEVICE_NAME, AcmeScheduling, AcmeWrapperCodegen,
                            AcmeCppWrapperCodegen, AcmeFxWrapperCodegen,
                            device_custom_pass=AcmeGraphPass(),
                            device_custom_config=inductor_config)
register_device_op_overrides(DEVICE_NAME, AcmeDeviceOpOverrides())
#< ch20 registration

