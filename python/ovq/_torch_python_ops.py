"""torch.ops.ovq.* registered in Python: what ovq.torch uses where ovq._torch_ops (the same ops
in C++) cannot serve (ovq built without PyTorch, another PyTorch installed since, or
OVQ_TORCH_OPS=python). Same schemas, results and errors; a call costs more (the dispatcher calls
back into Python, and torch.library's autograd wrapper runs in Python too). Backward through
these raises torch.library's error for an op without a backward formula.
"""

import itertools
import threading
import weakref

import torch

# handle -> MultiHead layer, for the ops (which see tensors only); the module owns the layer.
_LAYERS = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)
_LOCK = threading.Lock()


def _layer(handle, where):
    if (handle.dtype != torch.int64 or handle.numel() != 1 or handle.device.type != "cpu"
            or handle.layout != torch.strided):
        raise TypeError(f"{where}: handle is not a layer's handle, expected a one-element int64 "
                        "CPU tensor (ovq.torch.Attention.handle)")
    h = handle.item()
    try:
        return _LAYERS[h]
    except KeyError:
        raise RuntimeError(f"ovq.torch: no layer has handle {h} (it was freed, or never made)") \
            from None


def register(layer):
    """A new handle for `layer`, which the registry holds weakly."""
    with _LOCK:
        h = next(_NEXT_HANDLE)
        _LAYERS[h] = layer
    return h


def _one_output_op(name):
    """ovq::forward or ovq::step: the layer's method of that name, one output (B, Hq, [T,] dv)."""

    @torch.library.custom_op(f"ovq::{name}", mutates_args=("handle",))
    def op(handle: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           threads: int) -> torch.Tensor:
        return getattr(_layer(handle, name), name)(q, k, v, threads=threads)

    @op.register_fake
    def _(handle, q, k, v, threads):
        return q.new_empty(q.shape[:-1] + (v.shape[-1],))

    return op


_forward_op = _one_output_op("forward")
_step_op = _one_output_op("step")


@torch.library.custom_op("ovq::forward_lse", mutates_args=("handle",))
def _forward_lse_op(handle: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer(handle, "forward").forward(q, k, v, return_lse=True, threads=threads)


@_forward_lse_op.register_fake
def _(handle, q, k, v, threads):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (q.new_empty(q.shape[:-1] + (v.shape[-1],)), q.new_empty(q.shape[:-1], dtype=lse_dtype))


@torch.library.custom_op("ovq::absorb", mutates_args=("handle",))
def _absorb_op(handle: torch.Tensor, k: torch.Tensor, v: torch.Tensor, threads: int) -> None:
    _layer(handle, "absorb").absorb(k, v, threads=threads)


@_absorb_op.register_fake
def _(handle, k, v, threads):
    return None
