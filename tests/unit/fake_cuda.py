"""A CUDA device for a machine without one: tensors that say `cuda:0` and compute on the CPU, and that refuse
to meet a host tensor the way a real GPU does.

`fake_cuda()` makes llmc's GPU path run on CI's CPU-only machines: `torch.cuda.is_available()` is True, a tensor
moved or created on "cuda" becomes a `FakeCudaTensor` (a wrapper around a real CPU tensor, so every value, `.item()`
and file write is real), and any operation that mixes such a tensor with a host tensor raises torch's own
"Expected all tensors to be on the same device" error — the exact class of bug a real GPU throws and a CPU run
never sees. The rules follow CUDA's: a zero-dimensional host tensor may join a device operation (a scalar),
`copy_` and `to` cross devices, and advanced indexing takes host indices.

Why not torch's FakeTensorMode: it has no values, so data-dependent steps (`.item()`, GPTQ's solves, AWQ's search,
writing the quantized files) cannot run, and the pipeline stops long before the layers it should check.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
HOST = torch.device("cpu")

# operations that read tensors on two devices on a real GPU
_CROSS_DEVICE = {aten.copy_.default, aten._to_copy.default, aten._foreach_copy_.default, torch.Tensor.copy_}
# advanced indexing moves host index tensors to the indexed tensor's device
_HOST_INDICES = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
# composite operations whose kernel torch chooses by device before any dispatch (run on the host's kernel)
_HOST_KERNEL = {torch.nn.functional.scaled_dot_product_attention}


class FakeCudaTensor(torch.Tensor):
    """A tensor whose device is cuda:0 and whose values live in `_host`, a CPU tensor of the same shape."""

    _host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> FakeCudaTensor:
        t = torch.Tensor._make_wrapper_subclass(
            cls, host.shape, strides=host.stride(), storage_offset=host.storage_offset(), dtype=host.dtype,
            layout=host.layout, device=CUDA, requires_grad=host.requires_grad)
        t._host = host
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FakeCudaTensor({self._host!r})"

    # Triton's interpreter (TRITON_INTERPRET=1) reads and writes a kernel's arguments through their storage
    def untyped_storage(self) -> torch.UntypedStorage:
        return self._host.untyped_storage()

    def data_ptr(self) -> int:
        return self._host.data_ptr()

    # a traceable wrapper subclass: nn.Module.to() swaps such parameters in whole instead of `param.data = ...`
    def __tensor_flatten__(self):
        return ["_host"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return FakeCudaTensor(inner_tensors["_host"])

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


class DeviceMismatch(RuntimeError):
    """torch's error for an operation given tensors on two devices, as a real GPU raises it."""


def _device_of(t: torch.Tensor) -> torch.device:
    return CUDA if isinstance(t, FakeCudaTensor) else t.device


def _is_cuda(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _check_one_device(func, args, kwargs) -> bool:
    """Whether the operation runs on the (fake) GPU; raises where a real GPU would refuse the mix."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    on_gpu = any(isinstance(t, FakeCudaTensor) for t in tensors)
    if not on_gpu or func in _CROSS_DEVICE:
        return on_gpu
    host = [t for t in tensors if not isinstance(t, FakeCudaTensor) and t.device.type == "cpu" and t.dim() > 0]
    if func in _HOST_INDICES and host:
        indices = args[1] if len(args) > 1 else ()
        host = [t for t in host if not any(t is i for i in indices or ())]
    if host:
        raise DeviceMismatch(
            f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
            f"(in {func}: a host tensor of shape {tuple(host[0].shape)} met a cuda tensor)")
    return True


def _unwrap(x):
    return x._host if isinstance(x, FakeCudaTensor) else x


def _wrap_outputs(out, args):
    """Wrap each output tensor; an output that *is* an input's storage (in-place ops, `out=`) returns that input."""
    by_inner = {id(a._host): a for a in tree_flatten(args)[0] if isinstance(a, FakeCudaTensor)}

    def wrap(t):
        if not isinstance(t, torch.Tensor):
            return t
        same = by_inner.get(id(t))
        return FakeCudaTensor(t) if same is None else same

    return tree_map(wrap, out)


def _dispatch(func, args, kwargs):
    device = kwargs.get("device")
    if func is aten._to_copy.default and device is not None:  # .to(device): the target decides
        out = func(*tree_map(_unwrap, args), **{**kwargs, "device": HOST})
        return FakeCudaTensor(out) if _is_cuda(device) else out
    if func is aten.copy_.default:  # dst.copy_(src): dst keeps its device, whatever src's
        dst, src = args[0], args[1]
        dst_inner = _unwrap(dst)
        dst_inner.copy_(_unwrap(src), *args[2:], **kwargs)
        return dst
    if _is_cuda(device):  # a factory (empty, zeros, arange, ...) asked for the GPU
        return _wrap_outputs(func(*tree_map(_unwrap, args), **{**kwargs, "device": HOST}), ())
    on_gpu = _check_one_device(func, args, kwargs)
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if func is aten._local_scalar_dense.default or not on_gpu:
        return out
    return _wrap_outputs(out, (args, kwargs))


class _DispatchMode(TorchDispatchMode):
    """Catches factories asked for `device="cuda"` on host tensors' operations (no FakeCudaTensor argument)."""

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, FakeCudaTensor) for t in tree_flatten((args, kwargs))[0]) or _is_cuda(kwargs.get("device")):
            return _dispatch(func, args, kwargs)
        return func(*args, **kwargs)


def _target_device(args, kwargs) -> Any:
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return a
        if isinstance(a, torch.Tensor):  # t.to(other): other's device
            return _device_of(a)
    return None


_DATA = torch._C.TensorBase.data


def _set_data(target: torch.Tensor, value: torch.Tensor) -> None:
    """`target.data = value`: torch copies the tensor's metadata; the values a FakeCudaTensor holds move too."""
    if isinstance(target, FakeCudaTensor) != isinstance(value, FakeCudaTensor):
        raise NotImplementedError(
            "fake_cuda: `.data =` across devices (a parameter moved between host and GPU in place) is not emulated")
    _DATA.__set__(target, value)
    if isinstance(target, FakeCudaTensor):
        target._host = value._host


class _FunctionMode(TorchFunctionMode):
    """`host_tensor.to("cuda")` and `.cuda()` fail inside torch's C++ binding before any dispatch on a build without
    CUDA: do them here, as a copy wrapped on the fake device."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            device = CUDA if func is torch.Tensor.cuda else _target_device(args, kwargs)
            if _is_cuda(device):
                rest = [a for a in args[1:] if not isinstance(a, (str, torch.device, torch.Tensor))]
                dtype = kwargs.get("dtype") or next((a for a in rest if isinstance(a, torch.dtype)), None)
                if isinstance(args[0], FakeCudaTensor):  # already there: a dtype change at most, as torch does
                    return args[0] if dtype in (None, args[0].dtype) else args[0].to(dtype)
                moved = args[0].detach().to(dtype=dtype or args[0].dtype, copy=True)
                return FakeCudaTensor(moved.requires_grad_(args[0].requires_grad))
        # indexing builds a device guard in C++ before any dispatch: index the host values (a view, as torch's)
        if func is torch.Tensor.__getitem__ and isinstance(args[0], FakeCudaTensor):
            return FakeCudaTensor(args[0]._host[tree_map(_unwrap, args[1])])
        if func is torch.Tensor.__setitem__ and isinstance(args[0], FakeCudaTensor):
            args[0]._host[tree_map(_unwrap, args[1])] = _unwrap(args[2])
            return None
        if getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__":
            return _set_data(*args)
        if func is torch.Tensor.pin_memory:  # pinned host memory needs a CUDA context: keep the host tensor
            return args[0]
        if func in _HOST_KERNEL and any(isinstance(t, FakeCudaTensor) for t in tree_flatten((args, kwargs))[0]):
            # torch picks a composite op's kernel by the device it sees: a "cuda" tensor on a CPU build gets the math
            # decomposition, not the CPU's fused kernel, and rounds differently (SDPA: 2.4e-7). The fake GPU runs the
            # host's kernel, so the two paths compute the same numbers (GPTQ of an expert whose routed tokens are
            # fewer than its inputs turned that 2.4e-7 into codes 4 steps apart on an AVX2-only CPU).
            _check_one_device(func, args, kwargs)
            return _wrap_outputs(func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs)), (args, kwargs))
        # torch.tensor(data, device="cuda") allocates on the device in C++, below the dispatch mode
        if func is torch.tensor and _is_cuda(kwargs.get("device")):
            return FakeCudaTensor(torch.tensor(*args, **{**kwargs, "device": HOST}))
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            # A few of torch's Python bindings (contiguous, copy_, ...) build a CUDA device guard before any dispatch,
            # which a build without CUDA cannot: run those on the host values, with the same device check.
            if "not linked with support for cuda" not in str(e):
                raise
        on_gpu = _check_one_device(func, args, kwargs)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return _wrap_outputs(out, (args, kwargs)) if on_gpu else out


@contextlib.contextmanager
def fake_cuda(total_memory: int = 80 * 2**30) -> Iterator[None]:
    """Inside: torch reports one CUDA GPU of `total_memory` bytes (all free), and "cuda" tensors are
    FakeCudaTensors. Streams, events and synchronisation are no-ops (the CPU runs everything in order); gradients
    are off."""

    class _Stream:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

        def wait_event(self, event) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def record_event(self, event=None):
            return event or _Event()

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    class _Event(_Stream):
        def record(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return True

    properties = types.SimpleNamespace(name="fake-cuda (CPU)", total_memory=total_memory, major=9, minor=0,
                                       multi_processor_count=132)
    cuda = torch.cuda
    patches = {
        "_lazy_init": lambda: None, "is_available": lambda: True, "device_count": lambda: 1,
        "current_device": lambda: 0, "set_device": lambda d: None, "synchronize": lambda d=None: None,
        "empty_cache": lambda: None, "mem_get_info": lambda d=None: (total_memory, total_memory),
        "get_device_name": lambda d=None: properties.name, "get_device_properties": lambda d=None: properties,
        "get_device_capability": lambda d=None: (9, 0), "is_bf16_supported": lambda *a, **k: True,
        "max_memory_allocated": lambda d=None: 0, "memory_allocated": lambda d=None: 0,
        "reset_peak_memory_stats": lambda d=None: None, "Stream": _Stream, "Event": _Event,
        "current_stream": lambda d=None: _Stream(), "default_stream": lambda d=None: _Stream(),
        "stream": lambda s=None: _Stream(),
    }
    with contextlib.ExitStack() as stack:
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(cuda, name, value, create=True))
        # autograd records each device's default stream through a CUDA guard a CPU build lacks (an abort, not an
        # error); llmc computes nothing by autograd, so the fake GPU runs without it
        stack.enter_context(torch.no_grad())
        stack.enter_context(_FunctionMode())
        stack.enter_context(_DispatchMode())
        yield
