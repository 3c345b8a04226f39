"""Re-rotation of cached keys to new positions (content reuse, DESIGN.md "Content (non-prefix) reuse").

RoPE stores position in the keys only: HF's ``apply_rotary_pos_emb`` turns a raw key ``k`` into
``R(p * inv_freq) k`` (``k * cos + rotate_half(k) * sin``: channel ``i`` of the first half pairs with channel
``i + rotary_dim/2``, at angle ``p * inv_freq[i]``). Rotations compose, so a key cached at ``p_old`` is moved to
``p_new`` by the pure rotation ``R(delta * inv_freq)``, ``delta = p_new - p_old``. Values carry no position.

Two traps this module avoids:

- *Attention scaling.* YaRN (and longrope) multiply cos and sin by ``attention_scaling`` (e.g. 1.14 for a YaRN
  factor of 4). The cached key already carries that factor once; rotating it with the model's own
  ``rotary_emb(x, delta)`` cos/sin would scale it a second time. The rotation here is built from ``inv_freq``
  alone and is norm-preserving.
- *Length-dependent frequencies.* ``dynamic`` NTK recomputes ``inv_freq`` from the longest position of each
  forward, and ``longrope`` switches from ``short_factor`` to ``long_factor`` frequencies for the whole forward
  once it reaches past ``original_max_position_embeddings``. The KV of a token then depends on the *length of
  the forward* it was computed in, not only on its position and history: neither a content hit nor even an
  exact prefix hit (a prefix computed in a short forward differs from the same prefix inside a long one) is
  valid. :func:`check_rope_reusable` refuses such models (the engine calls it at construction), and so does
  :meth:`RopeRotator.from_model`. Rope types not known to be position-independent are refused the same way.

Supported rope types: ``default``, ``linear``, ``llama3``, ``yarn`` (their ``inv_freq`` is fixed at init and
``seq_len`` is ignored; checked in transformers 5.23 ``modeling_rope_utils``), with partial rotary dims (only the
first ``rotary_dim`` channels rotate), per-layer-type frequencies (Gemma 3 style ``layer_types``), NoPE layers
(SmolLM3 ``no_rope_layers``: their keys are left as they are) and the interleaved pair layout of Cohere/GLM.
:meth:`RopeRotator.from_model` checks all of that on the model itself with two one-token forwards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kvboost.models.compat import UnsupportedArchitectureError

#: Rope types whose frequencies do not depend on the sequence length (read in transformers 5.23).
POSITION_INDEPENDENT_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})

#: Families whose rotary pairs are adjacent channels (2i, 2i+1) instead of HF's rotate_half halves.
INTERLEAVED_MODEL_TYPES = frozenset({"cohere", "cohere2", "glm", "glm4"})

# Key dtypes rotated as they are; others (bf16, fp16) are rotated in float32 and rounded once.
_EXACT_DTYPES = (torch.float32, torch.float64)

__all__ = [
    "INTERLEAVED_MODEL_TYPES",
    "POSITION_INDEPENDENT_ROPE_TYPES",
    "LengthDependentRopeError",
    "RopeLayoutError",
    "RopeRotator",
    "check_rope_reusable",
    "rope_types",
]


class LengthDependentRopeError(UnsupportedArchitectureError):
    """The model's RoPE frequencies depend on the forward's length (or are not known not to): no KV reuse."""


class RopeLayoutError(UnsupportedArchitectureError):
    """The model's rotary embedding could not be found or did not behave as a pure rotation of its keys."""


# ---------------------------------------------------------------------------------------------- config checks
def _text_config(config: Any) -> Any:
    config = getattr(config, "config", config)  # a model is accepted too
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _rope_parameter_sets(config: Any) -> list[dict[str, Any]]:
    """The config's rope parameter dicts: one, or one per layer type when nested (Gemma 3 style)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    values = list(params.values())
    nested = params and "rope_type" not in params and "type" not in params and "rope_theta" not in params
    if nested and all(v is None or isinstance(v, dict) for v in values):
        return [v for v in values if v is not None]
    return [params]


def rope_types(config: Any) -> list[str]:
    """The rope types a config (or model) declares, e.g. ``["default"]`` or ``["default", "linear"]``."""
    text = _text_config(config)
    sets = _rope_parameter_sets(text)
    types = [str(p.get("rope_type", p.get("type", "default")) or "default") for p in sets]
    default = getattr(text, "default_rope_type", "default")
    return sorted(set(types)) or [default]


def check_rope_reusable(config: Any) -> None:
    """Refuse models whose RoPE frequencies depend on the sequence length (no KV reuse is valid for them).

    Raises :class:`LengthDependentRopeError` (an ``UnsupportedArchitectureError``) naming the rope type and why.
    Accepts a config or a model.
    """
    text = _text_config(config)
    model_type = getattr(text, "model_type", "?")
    for rope_type in rope_types(text):
        if "dynamic" in rope_type:
            raise LengthDependentRopeError(
                f"model type {model_type!r} uses rope type {rope_type!r} (dynamic NTK scaling): its RoPE frequencies "
                "are recomputed from the longest position of each forward, so a token's cached K/V depends on the "
                "length of the forward it was computed in. Neither prefix nor content KV reuse is valid; kvboost "
                "refuses this model (use a checkpoint with a fixed rope type: default, linear, llama3 or yarn)"
            )
        if rope_type == "longrope":
            omax = next(
                (p.get("original_max_position_embeddings") for p in _rope_parameter_sets(text)
                 if p.get("original_max_position_embeddings")),
                getattr(text, "original_max_position_embeddings", "?"),
            )  # fmt: skip
            raise LengthDependentRopeError(
                f"model type {model_type!r} uses rope type 'longrope': every forward that reaches past "
                f"original_max_position_embeddings ({omax}) switches ALL its positions from short_factor to "
                "long_factor frequencies, so a prefix's K/V computed in a short forward differs from the same prefix "
                "inside a long one. Neither prefix nor content KV reuse is valid; kvboost refuses this model"
            )
        if rope_type not in POSITION_INDEPENDENT_ROPE_TYPES:
            raise LengthDependentRopeError(
                f"model type {model_type!r} uses rope type {rope_type!r}, which kvboost does not know to be "
                "independent of the sequence length; KV reuse is refused for it (supported rope types: "
                f"{', '.join(sorted(POSITION_INDEPENDENT_ROPE_TYPES))})"
            )


# ---------------------------------------------------------------------------------------------- the rotator
def _find_rotary(model: Any) -> Any:
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        found = [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
        rotary = found[0] if len(found) == 1 else None
    if rotary is None:
        raise RopeLayoutError(
            f"{type(model).__name__}: no single rotary embedding module (``rotary_emb``) found; content reuse needs "
            "the model's inverse frequencies"
        )
    return rotary


def _layer_inv_freq(model: Any, text: Any, num_layers: int) -> list[torch.Tensor | None]:
    """Per decoder layer the inv_freq the model uses (``None``: a NoPE layer, keys carry no position)."""
    rotary = _find_rotary(model)
    module_types = getattr(rotary, "rope_type", None)
    if isinstance(module_types, dict):  # frequencies per layer type (Gemma 3: sliding vs full attention)
        layer_types = list(getattr(text, "layer_types", None) or [])
        if len(layer_types) != num_layers:
            raise RopeLayoutError(f"per-layer-type RoPE without one layer_types entry per layer ({layer_types})")
        for kind in set(module_types.values()):
            if kind not in POSITION_INDEPENDENT_ROPE_TYPES:
                check_rope_reusable(text)  # raises with the full message
                raise LengthDependentRopeError(f"rotary embedding of rope type {kind!r} is not supported")
        rows = [getattr(rotary, f"{t}_inv_freq", None) if t in module_types else None for t in layer_types]
    else:
        if module_types is not None and module_types not in POSITION_INDEPENDENT_ROPE_TYPES:
            raise LengthDependentRopeError(
                f"the model's rotary embedding runs rope type {module_types!r}, which kvboost does not know to be "
                f"independent of the sequence length (supported: {', '.join(sorted(POSITION_INDEPENDENT_ROPE_TYPES))})"
            )
        inv_freq = getattr(rotary, "inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor):
            raise RopeLayoutError(f"{type(rotary).__name__} has no inv_freq buffer")
        rows = [inv_freq] * num_layers
    no_rope = getattr(text, "no_rope_layers", None)  # SmolLM3 / Llama 4: entry i truthy = layer i uses RoPE
    if no_rope is not None:
        rows = [row if no_rope[i] else None for i, row in enumerate(rows)]
    return rows


class RopeRotator:
    """Moves cached keys between positions by a pure RoPE rotation (no attention scaling).

    Args:
        inv_freq: ``[rotary_dim // 2]`` (the same for every layer) or ``[num_layers, rotary_dim // 2]`` (per-layer;
            a NoPE layer has a zero row). Stored as float32 on its device.
        head_dim: channels per head; channels ``rotary_dim:`` are left as they are (partial rotary).
        layout: ``"half"`` (HF ``rotate_half``: channel i pairs with i + rotary_dim/2) or ``"interleaved"``
            (channel 2i pairs with 2i+1: Cohere, GLM).

    Angles are computed in float64 (float32 on MPS) so large deltas stay accurate; the rotation itself runs in
    the keys' dtype when it is float32/float64, otherwise in float32 with one rounding back to the keys' dtype.
    The rotator is a snapshot of the model's frequencies: build a new one after ``model.to(dtype)``.
    """

    def __init__(self, inv_freq: torch.Tensor, head_dim: int, *, layout: str = "half") -> None:
        if layout not in ("half", "interleaved"):
            raise ValueError(f"layout must be 'half' or 'interleaved', got {layout!r}")
        inv_freq = inv_freq.detach().to(torch.float32)
        if inv_freq.dim() == 2 and bool((inv_freq == inv_freq[:1]).all()):
            inv_freq = inv_freq[0]  # uniform: broadcasts over any leading dims
        if inv_freq.dim() not in (1, 2):
            raise ValueError(f"inv_freq must be [F] or [layers, F], got shape {tuple(inv_freq.shape)}")
        self.inv_freq = inv_freq.contiguous()
        self.rotary_dim = 2 * inv_freq.shape[-1]
        if self.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} > head_dim {head_dim}")
        self.head_dim = int(head_dim)
        self.layout = layout
        self._freq_cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model(cls, model: Any, *, verify: bool = True) -> RopeRotator:
        """The rotator of ``model``'s RoPE, built from its own ``inv_freq`` buffer(s).

        Raises ``LengthDependentRopeError`` for rope types whose frequencies depend on the sequence length (see
        :func:`check_rope_reusable`) and ``RopeLayoutError`` when the rotary embedding cannot be found or, with
        ``verify`` (default), when the model's own keys do not move as this rotator moves them (two one-token
        forwards: see :meth:`verify`). Both are ``UnsupportedArchitectureError``.
        """
        text = _text_config(model.config)
        check_rope_reusable(text)
        num_layers = int(text.num_hidden_layers)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        rows = _layer_inv_freq(model, text, num_layers)
        width = {int(r.numel()) for r in rows if r is not None}
        if len(width) > 1:
            raise RopeLayoutError(f"rotary dims differ between layers ({sorted(width)}); not supported")
        if not width:
            raise RopeLayoutError("no layer of this model uses RoPE; there is nothing to re-rotate")
        (f,) = width
        ref = next(r for r in rows if r is not None)
        table = torch.stack(
            [r.detach().float().to(ref.device) if r is not None else torch.zeros(f, device=ref.device) for r in rows]
        )
        model_type = getattr(text, "model_type", None)
        rotator = cls(table, head_dim, layout="interleaved" if model_type in INTERLEAVED_MODEL_TYPES else "half")
        if verify:
            rotator.verify(model)
        return rotator

    @property
    def per_layer(self) -> bool:
        """Whether the frequencies differ between layers (then keys need their layer dimension)."""
        return self.inv_freq.dim() == 2

    # ------------------------------------------------------------------ rotation
    def rotate(
        self,
        keys: torch.Tensor,
        delta: int | torch.Tensor,
        *,
        layer: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``keys`` rotated by ``delta`` positions, in a new tensor of their dtype and device (or in ``out``).

        Args:
            keys: ``[..., tokens, head_dim]``, e.g. stacked ``[layers, kv_heads, tokens, head_dim]``. With
                per-layer frequencies (:attr:`per_layer`) the layer dimension must be ``keys.shape[-4]``,
                unless ``layer`` says which layer all of ``keys`` belong to.
            delta: ``p_new - p_old``: an int (all tokens) or a LongTensor ``[tokens]`` (one per token).
            layer: the layer of ``keys`` when they hold one layer only (matters only with per-layer frequencies).
            out: where to write the result (same shape, any float dtype, must not overlap ``keys``: use
                :meth:`rotate_` for that), e.g. the destination rows of a preallocated cache: saves a copy.
        """
        cos, sin = self._cos_sin(keys, delta, layer)
        if out is None:
            out = torch.empty_like(keys)
        elif out.shape != keys.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, keys {tuple(keys.shape)}")
        if cos is None:
            return out.copy_(keys)
        if keys.dtype not in _EXACT_DTYPES:  # rotate a float32 copy in place, round once into out
            return out.copy_(self._rotate_inplace(keys.float(), cos, sin))
        dest = out if out.dtype == keys.dtype else torch.empty_like(keys)
        x1, x2 = self._halves(keys)
        o1, o2 = self._halves(dest)
        cos, sin = cos.to(keys.dtype), sin.to(keys.dtype)
        torch.mul(x1, cos, out=o1)
        o1.addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=o2)
        o2.addcmul_(x1, sin)
        if self.rotary_dim < self.head_dim:
            dest[..., self.rotary_dim :] = keys[..., self.rotary_dim :]
        return out if dest is out else out.copy_(dest)

    def rotate_(self, keys: torch.Tensor, delta: int | torch.Tensor, *, layer: int | None = None) -> torch.Tensor:
        """In-place :meth:`rotate`; returns ``keys``. Never call it on a stored entry's tensors.

        float32/float64 keys need a copy of half the rotary channels only; other dtypes are rotated in a float32
        copy and rounded once back into ``keys``."""
        cos, sin = self._cos_sin(keys, delta, layer)
        if cos is None:
            return keys
        if keys.dtype not in _EXACT_DTYPES:
            return keys.copy_(self._rotate_inplace(keys.float(), cos, sin))
        return self._rotate_inplace(keys, cos, sin)

    def _rotate_inplace(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = self._halves(x)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1_old = x1.clone()
        x1.mul_(cos).addcmul_(x2, sin, value=-1)
        x2.mul_(cos).addcmul_(x1_old, sin)
        return x

    def _halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rotary_dim
        if self.layout == "half":
            return x[..., : r // 2], x[..., r // 2 : r]
        return x[..., 0:r:2], x[..., 1:r:2]

    def _freq(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        freq = self._freq_cache.get(key)
        if freq is None:
            freq = self._freq_cache[key] = self.inv_freq.to(device=device, dtype=dtype)
        return freq

    def _cos_sin(
        self, keys: torch.Tensor, delta: int | torch.Tensor, layer: int | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """cos/sin broadcastable to the rotary half of ``keys``; ``(None, None)`` when delta is 0 everywhere."""
        if keys.shape[-1] != self.head_dim:
            raise ValueError(f"keys have {keys.shape[-1]} channels per head, the model {self.head_dim}")
        device = keys.device
        angle_dtype = torch.float32 if device.type == "mps" else torch.float64
        freq = self._freq(device, angle_dtype)
        if self.per_layer:
            if layer is not None:
                freq = freq[layer]
            elif keys.dim() < 4 or keys.shape[-4] != freq.shape[0]:
                raise ValueError(
                    f"this model's RoPE frequencies differ per layer: keys must be [..., {freq.shape[0]} layers, "
                    f"heads, tokens, head_dim] or rotated with layer=..., got shape {tuple(keys.shape)}"
                )
        if isinstance(delta, torch.Tensor) and delta.dim() > 0:
            if delta.dim() != 1 or delta.shape[0] != keys.shape[-2]:
                raise ValueError(f"per-token delta must be [{keys.shape[-2]}], got shape {tuple(delta.shape)}")
            d = delta.to(device=device, dtype=angle_dtype)
            angles = d[:, None] * freq[..., None, :]  # [tokens, F] or [layers, tokens, F]
        else:
            d = int(delta)
            if d == 0:
                return None, None
            angles = freq * float(d)  # [F] or [layers, F]
            if freq.dim() == 2:
                angles = angles[:, None, :]  # [layers, 1 token, F]
        if angles.dim() == 3:
            angles = angles[:, None]  # [layers, 1 head, tokens, F]
        return torch.cos(angles), torch.sin(angles)

    # ------------------------------------------------------------------ self-check
    @torch.no_grad()
    def verify(self, model: Any, *, position: int = 97, tolerance: float | None = None) -> float:
        """Check on ``model`` that a key moved from position 0 to ``position`` equals the model's own key there.

        Runs one token alone at position 0 and at ``position``: a lone token attends only to itself, so every
        layer's raw key is the same in both runs and the cached keys differ by RoPE alone. Returns the worst
        relative error over layers (max abs error / max abs key); raises ``RopeLayoutError`` above
        ``tolerance`` (1e-3 in float32, 3e-2 in half precision), naming the layer.
        """
        text = _text_config(model.config)
        limit = int(getattr(text, "max_position_embeddings", 0) or 0)
        if limit:
            position = min(position, limit - 1)
        device = next(model.parameters()).device
        # A mid-vocabulary token: low ids are often padding, whose embedding row may be zero (nothing to check).
        vocab = int(getattr(text, "vocab_size", 2))
        token = torch.tensor([[min(vocab // 2 + 1, vocab - 1)]], device=device)
        was_training = model.training
        model.eval()
        try:
            k0, kp = (self._probe_keys(model, token, p) for p in (0, position))
            moved = self.rotate(k0, position).float()
        except UnsupportedArchitectureError:
            raise
        except Exception as exc:  # a family whose forward or cache we cannot read this way
            raise RopeLayoutError(f"could not check the model's RoPE with a one-token forward: {exc!r}") from exc
        finally:
            model.train(was_training)
        if tolerance is None:
            tolerance = 1e-3 if k0.dtype in _EXACT_DTYPES else 3e-2
        kp = kp.float()
        err = (moved - kp).abs().amax(dim=(-3, -2, -1)) / kp.abs().amax(dim=(-3, -2, -1)).clamp_min(1e-12)
        worst = int(err.argmax())
        if float(err[worst]) > tolerance:
            raise RopeLayoutError(
                f"{type(model).__name__}: a key moved by this rotator from position 0 to {position} differs from the "
                f"model's own key at layer {worst} (relative error {float(err[worst]):.2e} > {tolerance:.0e}); its "
                f"RoPE layout ({self.layout}, rotary_dim {self.rotary_dim}) is not what kvboost assumed, so content "
                "reuse is refused"
            )
        return float(err.max())

    @staticmethod
    def _probe_keys(model: Any, token: torch.Tensor, position: int) -> torch.Tensor:
        from kvboost.runtime.hf_generic import output_cache

        pos = torch.tensor([[position]], device=token.device)
        out = model(input_ids=token, position_ids=pos, use_cache=True)
        layers: Iterable[Any] = getattr(output_cache(out), "layers", None) or []
        keys = [layer.keys[0] for layer in layers]  # [kv_heads, 1, head_dim] each
        if not keys:
            raise RopeLayoutError(f"{type(model).__name__}: the forward returned no per-layer key cache to check")
        return torch.stack(keys)  # [layers, kv_heads, 1, head_dim]
