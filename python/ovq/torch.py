"""ovq.torch: the mixers as PyTorch operators and nn.Module layers.

    import torch, ovq, ovq.torch
    layer = ovq.torch.Attention(ovq.OVQAttention(capacity=1024), batch=1, query_heads=8,
                                kv_heads=8, dk=64, dv=64)
    o = layer(q, k, v)              # (B, Hq, T, dk), (B, Hkv, T, dk), (B, Hkv, T, dv) -> (B, Hq, T, dv)
    o_t = layer.step(q_t, k_t, v_t) # (B, Hq, dk), ... -> (B, Hq, dv)

A layer's states live in the extension; the module holds a one-element int64 buffer, its
handle, which every op takes and declares mutated (``Tensor(a!)``), so that torch.compile keeps
the calls in order and ``torch.compile(fullgraph=True)`` compiles a module calling them with no
graph break (each op has a fake implementation giving its output's shape). In eager mode the
layer calls the extension directly. The ops are forward only: backward through them raises a
RuntimeError saying so. ``state_dict()`` carries the states'
bytes (the state file), so ``torch.save`` / ``load_state_dict`` round-trip them bitwise.

The ops torch.ops.ovq.{forward, forward_lse, step, absorb} are registered in C++
(ovq._torch_ops, built where PyTorch was importable when ovq was built) while the PyTorch
installed is the one it was built against; otherwise, or with the environment variable
OVQ_TORCH_OPS=python, they are registered in Python (ovq._torch_python_ops: the same results,
more time per call). ``NATIVE_OPS`` says which.
"""

import os
import warnings

import torch

import ovq

__all__ = ["Attention", "OVQAttention", "SelfAttention", "LinearAttention", "VQAttention",
           "NATIVE_OPS"]

_FORWARD_ONLY = ("ovq.torch: the ovq ops are forward only; there is no backward through "
                 "{name} (detach its inputs, or run it under torch.no_grad())")


def _load_native_ops():
    """Registers the C++ ops (ovq._torch_ops) if they can serve this PyTorch; says whether."""
    if os.environ.get("OVQ_TORCH_OPS", "") == "python":
        return False
    try:
        from ovq import _torch_ops_build
    except ImportError:  # ovq was built where PyTorch was not importable
        return False
    why = None
    if _torch_ops_build.torch_version != torch.__version__:
        why = f"was built against PyTorch {_torch_ops_build.torch_version}, not {torch.__version__}"
    else:
        try:
            from ovq import _torch_ops  # noqa: F401  (registers torch.ops.ovq.*)
        except ImportError as e:  # (it registers nothing unless it loads whole)
            why = f"does not load ({e})"
    if why is not None:
        warnings.warn(f"ovq._torch_ops {why}: torch.ops.ovq.* run in Python, which costs more per "
                      "call (rebuild ovq: pip install --no-build-isolation ./python)",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


NATIVE_OPS = _load_native_ops()

if NATIVE_OPS:
    def _register(layer):
        """The handle the ops know `layer` by (the extension's; it dies with the layer)."""
        return layer._impl._op_handle()
else:
    from ovq._torch_python_ops import register as _register


class _ForwardOnly(torch.autograd.Function):
    """Passes an output through, with a backward that says the ops have none."""

    @staticmethod
    def forward(ctx, name, out, *inputs):
        ctx.name = name
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_FORWARD_ONLY.format(name=ctx.name))


def _forward_only(name, outputs, *inputs):
    """Eager calls whose inputs require grad: outputs whose backward raises a clear error.
    (The ops raise at backward themselves: the same error from the C++ ops, torch.library's
    for a missing formula from the Python ones.)"""
    if not (any(t.requires_grad for t in inputs) and torch.is_grad_enabled()):
        return outputs
    if isinstance(outputs, tuple):
        return tuple(_ForwardOnly.apply(name, o, *inputs) for o in outputs)
    return _ForwardOnly.apply(name, outputs, *inputs)


class Attention(torch.nn.Module):
    """An ovq mixer over (B, H, T, d) tensors, with its states (a MultiHead layer).

    Attention(mixer, batch, query_heads, kv_heads, dk, dv, dtype=torch.float32,
    normalize_qk=False, threads=0, codebooks=None, betas=None): normalize_qk L2-normalises q
    and k along their last dimension first; codebooks (Hkv, S, dk) for VQ-attention; betas (Hq
    numbers) one logit scale per query head (ovq.MultiHead). Every call continues from the
    states; reset() forgets them.
    """

    def __init__(self, mixer, batch, query_heads, kv_heads=None, dk=None, dv=None, *,
                 dtype=torch.float32, normalize_qk=False, threads=0, codebooks=None,
                 betas=None):
        super().__init__()
        self.mixer = mixer
        self.normalize_qk = normalize_qk
        self.threads = threads
        self.layer = ovq.MultiHead(mixer, batch, query_heads, kv_heads, dk, dv, dtype=dtype,
                                   codebooks=codebooks, betas=betas)
        handle = _register(self.layer)
        self.register_buffer("handle", torch.tensor([handle], dtype=torch.int64), persistent=False)

    def _qk(self, q, k):
        if self.normalize_qk:
            q = torch.nn.functional.normalize(q, dim=-1)
            k = torch.nn.functional.normalize(k, dim=-1)
        return q.contiguous(), k.contiguous()

    def forward(self, q, k, v, return_lse=False):
        """(B, Hq, T, dk), (B, Hkv, T, dk), (B, Hkv, T, dv) -> (B, Hq, T, dv)
        [, lse (B, Hq, T)]."""
        q, k = self._qk(q, k)
        v = v.contiguous()
        if torch.compiler.is_compiling():
            op = torch.ops.ovq.forward_lse if return_lse else torch.ops.ovq.forward
            return op(self.handle, q, k, v, self.threads)
        out = self.layer.forward(q, k, v, return_lse=return_lse, threads=self.threads)
        return _forward_only("ovq::forward", out, q, k, v)

    def step(self, q, k, v):
        """One token per head: (B, Hq, dk), (B, Hkv, dk), (B, Hkv, dv) -> (B, Hq, dv)."""
        q, k = self._qk(q, k)
        v = v.contiguous()
        if torch.compiler.is_compiling():
            return torch.ops.ovq.step(self.handle, q, k, v, self.threads)
        out = self.layer._impl._step(q, k, v, None, self.threads)
        if q.requires_grad or k.requires_grad or v.requires_grad:
            return _forward_only("ovq::step", out, q, k, v)
        return out

    def absorb(self, k, v):
        """Writes (B, Hkv, T, dk), (B, Hkv, T, dv) into the states, with no outputs."""
        if self.normalize_qk:
            k = torch.nn.functional.normalize(k, dim=-1)
        k, v = k.contiguous(), v.contiguous()
        if torch.compiler.is_compiling():
            torch.ops.ovq.absorb(self.handle, k, v, self.threads)
        else:
            self.layer.absorb(k, v, threads=self.threads)

    def reset(self):
        self.layer.reset()

    def __setstate__(self, state):
        # A copy (copy.deepcopy, pickle) has a layer of its own, which needs a handle of its own:
        # the copied one names the original's layer, or in another process whichever has it.
        super().__setstate__(state)
        self.handle.fill_(_register(self.layer))

    def get_extra_state(self):
        return torch.frombuffer(bytearray(self.layer.to_bytes()), dtype=torch.uint8)

    def set_extra_state(self, state):
        self.layer.load_bytes(state)

    def extra_repr(self):
        return (f"{self.mixer!r}, batch={self.layer.batch}, query_heads={self.layer.query_heads}, "
                f"kv_heads={self.layer.kv_heads}, dk={self.layer.dk}, dv={self.layer.dv}, "
                f"dtype={self.layer.dtype}, normalize_qk={self.normalize_qk}")


def _named(mixer_cls, doc):
    class Named(Attention):
        __doc__ = doc

        def __init__(self, batch, query_heads, kv_heads=None, dk=None, dv=None, *,
                     dtype=torch.float32, normalize_qk=False, threads=0, codebooks=None,
                     betas=None, **options):
            super().__init__(mixer_cls(**options), batch, query_heads, kv_heads, dk, dv,
                             dtype=dtype, normalize_qk=normalize_qk, threads=threads,
                             codebooks=codebooks, betas=betas)

    Named.__name__ = Named.__qualname__ = mixer_cls.__name__
    return Named


OVQAttention = _named(ovq.OVQAttention, "Attention over ovq.OVQAttention(**options).")
SelfAttention = _named(ovq.SelfAttention, "Attention over ovq.SelfAttention(**options).")
LinearAttention = _named(ovq.LinearAttention, "Attention over ovq.LinearAttention(**options).")
VQAttention = _named(ovq.VQAttention, "Attention over ovq.VQAttention(**options); codebooks=.")
