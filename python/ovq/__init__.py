"""ovq: sequence mixers for long contexts over NumPy arrays and PyTorch tensors.

The four mixers of the C++ library (OVQ-attention, self-attention, linear attention,
VQ-attention) with the same options, states and bits::

    import numpy as np, ovq
    mixer = ovq.OVQAttention(capacity=1024, chunk=64)
    state = mixer.make_state(dk=64, dv=64)             # float32 unless dtype= says otherwise
    o = mixer.forward(state, q, k, v)                  # q, k: (T, dk), v: (T, dv) -> (T, dv)
    o_t = mixer.step(state, q_t, k_t, v_t)             # one token: (dk,), (dk,), (dv,) -> (dv,)

Arrays are read in place: C-contiguous NumPy arrays or CPU torch tensors of the state's dtype
(float32, float64, and bfloat16 / float16 for torch tensors). Anything else raises TypeError
or ValueError naming the argument; the library's checks raise ValueError and leave the state
untouched. Outputs are new arrays of the inputs' kind (NumPy or torch), or ``out=``.
The GIL is released while a mixer computes; ``threads=`` bounds its OpenMP threads.
"""

import os
import sys
import tempfile

import numpy as np

from . import _ovq
from ._ovq import (
    Growth,
    LinearAttentionState,
    OVQAttentionState,
    Seeding,
    SelfAttentionState,
    UpdateRate,
    VQAttentionState,
)

__all__ = [
    "OVQAttention",
    "SelfAttention",
    "LinearAttention",
    "VQAttention",
    "MultiHead",
    "Growth",
    "Seeding",
    "UpdateRate",
    "SelfAttentionState",
    "LinearAttentionState",
    "VQAttentionState",
    "OVQAttentionState",
    "merge",
    "fit_codebook",
    "save_state",
    "load_state",
    "simd",
]

__version__ = "0.1.0"

#: The SIMD the extension was compiled for on this machine ("avx512bf16", "avx512", "avx2"
#: or "scalar").
simd = _ovq.simd

_DTYPES = ("float32", "float64", "bfloat16", "float16")


def _dtype_name(dtype):
    """'float32', 'float64', 'bfloat16' or 'float16' from a name, a NumPy or a torch dtype."""
    if isinstance(dtype, str):
        name = dtype
    else:
        text = str(dtype)
        if text.startswith("torch."):
            name = text[len("torch."):]
        else:
            try:
                name = np.dtype(dtype).name
            except TypeError:
                name = text
    if name not in _DTYPES:
        raise TypeError(f"dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    return name


def _compute_dtype(name):
    return "float64" if name == "float64" else "float32"


def _is_torch(x):
    """A torch tensor (subclasses included); torch is only looked at if the caller imported it."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _view(x):
    """For the extension's less frequent calls (merge, codebooks): a CPU torch tensor as the
    NumPy array sharing its memory; bfloat16 tensors (NumPy has no bfloat16), tensors on a
    device and anything else as they are, for the extension to read or to name what is wrong
    with them. (The mixers' calls read tensors directly.)"""
    global _BFLOAT16
    if not _is_torch(x):
        return x
    if _BFLOAT16 is None:
        _BFLOAT16 = sys.modules["torch"].bfloat16
    if x.dtype is _BFLOAT16 or x.is_cuda:
        return x
    try:
        return (x.detach() if x.requires_grad else x).numpy()
    except (TypeError, RuntimeError):
        return x


_BFLOAT16 = None  # torch.bfloat16, once a tensor has been seen (ovq does not import torch)


_TORCH_DTYPES = {}  # dtype name -> torch dtype, once a tensor has been seen


def _empty(like, shape, dtype_name):
    """An uninitialised array of the kind of `like` (NumPy or torch, on its device)."""
    if _is_torch(like):
        if not _TORCH_DTYPES:
            torch = sys.modules["torch"]
            _TORCH_DTYPES.update((n, getattr(torch, n)) for n in _DTYPES)
        return like.new_empty(shape, dtype=_TORCH_DTYPES[dtype_name])
    if dtype_name == "bfloat16":
        raise TypeError("bfloat16 needs torch tensors: NumPy has no bfloat16")
    return np.empty(shape, dtype=dtype_name)


def _ndim(x, name):
    try:
        return x.ndim  # (a nested tensor has no shape, but has its dimensions)
    except AttributeError:
        raise TypeError(
            f"{name} is a {type(x).__name__}, expected a NumPy array or a torch tensor"
        ) from None


# Passed for an output whose shape cannot be known because an input has the wrong rank: the
# extension then reports that input.
_PLACEHOLDER = np.empty(0, dtype=np.float32)


def _state_dtype(state):
    try:
        return state.dtype
    except AttributeError:
        raise TypeError(f"state is a {type(state).__name__}, expected an ovq state "
                        "(from make_state)") from None


class _Mixer:
    """What the four mixers share; see each one's docstring for its options."""

    _Impl = None
    _Layer = None

    def __init__(self, **options):
        self._impl = self._Impl(**options)
        self._impl._check_dtype("float32")

    @property
    def options(self):
        """The mixer's options, as keyword arguments of its constructor."""
        return self._impl.options()

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"ovq.{type(self).__name__}({opts})"

    def __eq__(self, other):
        return type(self) is type(other) and self.options == other.options

    __hash__ = None

    def __reduce__(self):
        return (_rebuild_mixer, (type(self), self.options))

    def forward(self, state, q, k, v, *, out=None, return_lse=False, threads=0):
        """Outputs of T tokens, continuing from `state` (which then holds them too).

        q, k: (T, dk), v: (T, dv) of the state's dtype -> (T, dv); with return_lse=True also
        each query's log-sum-exp (T,) in float32 (float64 for float64 states): what merging
        partial attention needs (see ovq.merge). Softmax mixers only.
        """
        if out is None:
            if _ndim(q, "q") == 2 and _ndim(v, "v") == 2:
                out = _empty(q, (q.shape[0], v.shape[1]), _state_dtype(state))
            else:
                out = _PLACEHOLDER
        lse = None
        if return_lse:
            lse = _empty(q, (q.shape[0],) if _ndim(q, "q") == 2 else (0,),
                         _compute_dtype(_state_dtype(state)))
        self._impl._forward(state, q, k, v, out, lse, threads)
        return (out, lse) if return_lse else out

    def step(self, state, q, k, v, *, out=None, threads=0):
        """One token: q, k: (dk,), v: (dv,) -> (dv,); the same bits as forward over it."""
        return self._impl._step(state, q, k, v, out, threads)

    def absorb(self, state, k, v, *, threads=0):
        """Writes k (T, dk), v (T, dv) into the state without outputs (encoding a context)."""
        self._impl._absorb(state, k, v, threads)

    def load_state(self, data):
        """The state whose state-file bytes are `data` (bytes, or a uint8 array / tensor)."""
        return self._impl._decode(_as_bytes(data))

    def can_run(self, state):
        """Whether this mixer's options fit the state (capacity, chunk, window)."""
        return self._impl._matches(state)


def _rebuild_mixer(cls, options):
    return cls(**options)


def _as_bytes(data):
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if _is_torch(data):
        data = data.detach().cpu().numpy()
    return np.ascontiguousarray(data, dtype=np.uint8).tobytes()


class SelfAttention(_Mixer):
    """Softmax attention over a key/value cache: causal, sliding-window or non-causal.

    SelfAttention(beta=1.0, causal=True, window=0, chunk=4096): window W >= 1 lets a token see
    itself and the W - 1 before it (0: unbounded); non-causal queries see every key of the
    state and of the call.
    """

    _Impl = _ovq._SelfAttention

    def make_state(self, dk, dv, dtype="float32"):
        """An empty cache for keys of width dk and values of width dv."""
        return self._impl._make_state(dk, dv, _dtype_name(dtype))


class LinearAttention(_Mixer):
    """Linear attention with a feature map and a scalar decay, computed in chunks.

    LinearAttention(beta=1.0, feature_map='identity' | 'elu1' | 'relu', normalize=False,
    decay=1.0, eps=1e-6, chunk=64). Its state has a constant size (S: dk x dv, z: dk).
    """

    _Impl = _ovq._LinearAttention

    def make_state(self, dk, dv, dtype="float32"):
        return self._impl._make_state(dk, dv, _dtype_name(dtype))

    def chain(self, prefix, summary):
        """The state after `prefix`'s tokens then those summarised in `summary` (a state that
        started empty): S = decay^b S_prefix + S_summary over the summary's b folded tokens.
        `prefix` must hold a multiple of the chunk. Sequence parallelism: summarise shards
        apart, chain them in order."""
        return self._impl._chain(prefix, summary)


class VQAttention(_Mixer):
    """Attention over a fixed codebook of keys with running-mean values.

    VQAttention(beta=1.0, chunk=64); make_state(codebook, dv) with codebook (S, dk), for
    instance from ovq.fit_codebook.
    """

    _Impl = _ovq._VQAttention

    def make_state(self, codebook, dv):
        """A state over `codebook` (S, dk; its dtype is the state's) with values of width dv."""
        if _is_torch(codebook):
            codebook = codebook.detach()
        return self._impl._make_state(_view(codebook), dv)


class OVQAttention(_Mixer):
    """OVQ-attention: attention over an online dictionary learnt by sparse k-means.

    OVQAttention(capacity=1024, chunk=64, beta=1.0, growth=Growth.dirichlet(),
    seeding=Seeding.spread(), rate=UpdateRate.adaptive(), renormalize=False,
    renormalize_values=False, count_bias=True, value_update='mean' | 'delta').
    OVQAttention.preset(name, **options) starts from a preset (OVQAttention.presets: 'default',
    'kvm', the public implementation's reading, and 'kvm-delta', the same with the delta-rule
    value update; docs/math.md, "Two readings of the paper") and overrides the given options.
    """

    _Impl = _ovq._OVQAttention
    presets = _ovq._ovq_presets

    @classmethod
    def preset(cls, name, **options):
        """The mixer of preset `name` with `options` overriding its own."""
        return cls(**{**_ovq._ovq_preset(name), **options})

    def make_state(self, dk, dv, dtype="float32"):
        return self._impl._make_state(dk, dv, _dtype_name(dtype))


class MultiHead:
    """Batch x heads around a mixer, with grouped queries (Hq a multiple of Hkv).

    MultiHead(mixer, batch, query_heads, kv_heads, dk, dv, dtype='float32'), or for
    VQ-attention MultiHead(mixer, batch, query_heads, codebooks=(Hkv, S, dk), dv=dv).
    betas= (Hq numbers) gives each query head a logit scale of its own in place of the
    mixer's beta (self, VQ and OVQ attention); under OVQ's delta rule the query heads of one
    key/value head share theirs.
    forward(q (B, Hq, T, dk), k (B, Hkv, T, dk), v (B, Hkv, T, dv)) -> (B, Hq, T, dv), like
    contiguous tensors in PyTorch's layout; query head h reads key/value head
    h // (Hq // Hkv). Each (batch, key/value head) has its own state; they run in parallel.
    """

    def __init__(self, mixer, batch, query_heads, kv_heads=None, dk=None, dv=None, *,
                 dtype="float32", codebooks=None, betas=None):
        if not isinstance(mixer, _Mixer):
            raise TypeError(f"mixer is a {type(mixer).__name__}, expected an ovq mixer")
        self.mixer = mixer
        if isinstance(mixer, VQAttention):
            if codebooks is None or dv is None:
                raise TypeError("MultiHead over VQAttention needs codebooks=(Hkv, S, dk) and dv=")
            if kv_heads is not None and kv_heads != codebooks.shape[0]:
                raise ValueError(f"kv_heads = {kv_heads}, expected {codebooks.shape[0]} "
                                 "(one codebook per key/value head)")
            if _is_torch(codebooks):
                codebooks = codebooks.detach()
            self._impl = mixer._impl._make_layer(batch, query_heads, _view(codebooks), dv)
        else:
            if codebooks is not None:
                raise TypeError("codebooks= is for VQAttention only")
            if kv_heads is None or dk is None or dv is None:
                raise TypeError("MultiHead needs kv_heads, dk and dv")
            self._impl = mixer._impl._make_layer(batch, query_heads, kv_heads, dk, dv,
                                                 _dtype_name(dtype))
        if betas is not None:
            self._impl.set_head_betas([float(b) for b in betas])

        self._cache_shape()

    betas = property(lambda self: tuple(self._impl.head_betas) or None,
                     doc="The per-query-head betas, or None (the mixer's beta for every head).")

    def _cache_shape(self):
        # Plain attributes: read on every call, cheaper than the extension's properties.
        impl = self._impl
        self.dtype, self.batch, self.query_heads = impl.dtype, impl.batch, impl.query_heads
        self.kv_heads, self.dk, self.dv = impl.kv_heads, impl.dk, impl.dv

    bytes = property(lambda self: self._impl.bytes, doc="Bytes of memory the states take.")

    def forward(self, q, k, v, *, out=None, return_lse=False, threads=0):
        """(B, Hq, T, dk), (B, Hkv, T, dk), (B, Hkv, T, dv) -> (B, Hq, T, dv) [, lse (B, Hq, T)]."""
        four = _ndim(q, "q") == 4
        if out is None:
            out = (_empty(q, (self.batch, self.query_heads, q.shape[2], self.dv), self.dtype)
                   if four else _PLACEHOLDER)
        lse = None
        if return_lse:
            lse = _empty(q, (self.batch, self.query_heads, q.shape[2]) if four else (0, 0, 0),
                         _compute_dtype(self.dtype))
        self._impl._forward(q, k, v, out, lse, threads)
        return (out, lse) if return_lse else out

    def step(self, q, k, v, *, out=None, threads=0):
        """One token per head: (B, Hq, dk), (B, Hkv, dk), (B, Hkv, dv) -> (B, Hq, dv)."""
        return self._impl._step(q, k, v, out, threads)

    def absorb(self, k, v, *, threads=0):
        """Writes k (B, Hkv, T, dk), v (B, Hkv, T, dv) into every state, without outputs."""
        self._impl._absorb(k, v, threads)

    def reset(self):
        self._impl.reset()

    def state(self, b, kv_head):
        """A copy of the state of batch entry b and key/value head kv_head."""
        return self._impl.state(b, kv_head)

    def to_bytes(self):
        """The state file's bytes of every state (what save_state writes)."""
        return self._impl.to_bytes()

    def load_bytes(self, data):
        """Replaces every state by those of a state file's bytes (unchanged on error)."""
        self._impl._load_bytes(_as_bytes(data))

    def __copy__(self):
        other = object.__new__(MultiHead)
        other.mixer = self.mixer
        other._impl = self._impl.__copy__()
        other._cache_shape()
        return other

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __reduce__(self):
        return (_rebuild_layer, (self.mixer, self.to_bytes(), self._shape()))

    def _shape(self):
        s = self._impl.state(0, 0)
        n = s.n if isinstance(self.mixer, VQAttention) else None
        return (self._impl.batch, self._impl.query_heads, self._impl.kv_heads, self._impl.dk,
                self._impl.dv, self._impl.dtype, n, self.betas)


def _rebuild_layer(mixer, data, shape):
    batch, hq, hkv, dk, dv, dtype, n, betas = shape
    if isinstance(mixer, VQAttention):
        codebooks = np.zeros((hkv, n, dk), dtype=np.float32 if dtype != "float64" else np.float64)
        if dtype in ("bfloat16", "float16"):
            import torch

            codebooks = torch.zeros((hkv, n, dk), dtype=getattr(torch, dtype))
        layer = MultiHead(mixer, batch, hq, codebooks=codebooks, dv=dv, betas=betas)
    else:
        layer = MultiHead(mixer, batch, hq, hkv, dk, dv, dtype=dtype, betas=betas)
    layer.load_bytes(data)
    return layer


def merge(o_a, lse_a, o_b, lse_b):
    """Merges two partial reads of the same queries over disjoint sets of keys.

    o: (..., dv) softmax averages, lse: (...) their log-sum-exps (forward(..., return_lse=True));
    returns (o, lse) of the read over both sets: lse = log(e^lse_a + e^lse_b),
    o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b. A side with lse = -inf saw nothing.
    """
    if _is_torch(o_a):
        o, lse = o_a.detach().clone(), lse_a.detach().clone()
        o_b, lse_b = o_b.detach(), lse_b.detach()
    else:
        o, lse = np.array(o_a, copy=True), np.array(lse_a, copy=True)
    _ovq._merge(_view(o), _view(lse), _view(o_b), _view(lse_b))
    return o, lse


def fit_codebook(keys, size, *, max_iterations=25, tolerance=1e-4, seed=0):
    """A VQ codebook (size, dk) by k-means++ and Lloyd iterations over keys (n, dk)."""
    torch_in = _is_torch(keys)
    if torch_in:
        keys = keys.detach()
    codebook = _ovq._fit_codebook(_view(keys), size, max_iterations, tolerance, seed)
    if torch_in:
        import torch

        return torch.from_numpy(np.array(codebook))
    return np.array(codebook)


def save_state(path, state):
    """Writes a state (or a MultiHead layer's states) to `path` as an ovq state file, atomically:
    the same file the C++ io::save_state writes."""
    data = state.to_bytes()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ovq-state-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_state(path, mixer_or_layer):
    """Reads a state file: returns the state for a mixer's options, or loads every state of a
    MultiHead layer in place (and returns the layer)."""
    with open(path, "rb") as f:
        data = f.read()
    if isinstance(mixer_or_layer, MultiHead):
        mixer_or_layer.load_bytes(data)
        return mixer_or_layer
    if not isinstance(mixer_or_layer, _Mixer):
        raise TypeError(f"load_state: expected an ovq mixer or MultiHead, got "
                        f"{type(mixer_or_layer).__name__}")
    return mixer_or_layer.load_state(data)
