"""``EPMoE.forward`` as one opaque custom op for ``torch.compile``.

The layer's forward reads values back to the host (chunk counts, the agreement, count
exchanges of the backends), which the compiler cannot trace without graph breaks, and
``fullgraph=True`` refuses. Under ``torch.compile`` the layer therefore calls
``torch.ops.epmoe.moe_forward(hidden_states, router_logits, layer_id, max_tokens,
num_valid_tokens, params)``: the
compiler sees one op whose output is ``[T, H]`` in the input's dtype (the fake
implementation) and, at run time, the op runs the layer's eager forward.

* ``layer_id``: the layer's key in a registry of live layers (weak references, so a freed
  layer leaves it); set at construction, passed as a CPU int64 scalar tensor: an input
  of the compiled graph, not a constant, so layers compiled one by one share one graph.
* ``max_tokens``: the step's largest token count (``max_tokens_across_ranks``), or ``None``:
  the op resolves it at run time from the active ``epmoe.step`` (read when the op runs,
  so a compiled model serves every step without recompiling), else by the layer's own
  agreement.

Registering the op is this module's only import-time effect (``import epmoe`` does not
import it; ``epmoe.layer`` does).
"""

from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["live_layers", "lookup", "moe_forward", "no_backward", "register"]

_layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_ids = itertools.count()


def register(layer) -> int:
    """Register ``layer`` (an ``EPMoE``) and return its id for the op."""
    layer_id = next(_ids)
    _layers[layer_id] = layer
    return layer_id


def live_layers() -> list:
    """Every live registered layer."""
    return list(_layers.values())


def lookup(layer_id: int):
    """The live layer registered under ``layer_id``."""
    layer = _layers.get(layer_id)
    if layer is None:
        raise RuntimeError(
            f"epmoe::moe_forward: no live EPMoE layer has id {layer_id} (it was freed); "
            "compile the model again after rebuilding its layers"
        )
    return layer


# cudagraph_unsafe: a captured replay would freeze the step's agreed token bound (its chunk
# count and backend), so Inductor's CUDA graphs leave this op outside their captures
@torch.library.custom_op("epmoe::moe_forward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def moe_forward(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    layer_id: torch.Tensor,
    max_tokens: int | None,
    num_valid_tokens: torch.Tensor | None,
    params: list[torch.Tensor],
) -> torch.Tensor:
    """``[T, H]``, ``[T, E]`` → ``[T, H]``: layer ``layer_id``'s eager forward (``max_tokens``
    and ``num_valid_tokens`` as the layer's forward takes ``max_tokens_across_ranks`` and
    ``num_valid_tokens``; ``None``: from the active step or the layer's agreement; a bad
    value is refused as eagerly). ``layer_id``: a CPU int64 scalar tensor, an input of the
    graph rather than a constant, so one compiled graph serves every layer. ``params``: the
    layer's parameters that require grad (its shared experts'), unused but for autograd:
    a backward through the op reaches them and raises, never a silent zero gradient."""
    layer = lookup(int(layer_id))
    out = layer._eager_forward(
        hidden_states,
        router_logits,
        max_tokens_across_ranks=max_tokens,
        num_valid_tokens=num_valid_tokens,
    )
    # a custom op may not return an alias of an input (T = 0, same dtype: .to() is a no-op)
    storage = out.untyped_storage().data_ptr()
    aliased = any(t.untyped_storage().data_ptr() == storage for t in (hidden_states, router_logits))
    return out.clone() if aliased else out


@moe_forward.register_fake
def _(hidden_states, router_logits, layer_id, max_tokens, num_valid_tokens, params):
    return hidden_states.new_empty(hidden_states.shape)  # contiguous, like the real op


NO_BACKWARD = (
    "EPMoE has no backward: it is an inference layer (its dispatch and combine are not "
    "differentiable across ranks). Run the model under torch.no_grad() or "
    "torch.inference_mode()"
)


@torch.library.custom_op("epmoe::no_backward", mutates_args=())
def no_backward(grad_output: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """A gradient of ``shape`` that ``moe_forward`` would pass back to one of its inputs:
    raises with the fix when a backward runs. (An op, so that tracing the backward at
    compile time does not raise.)"""
    raise RuntimeError(NO_BACKWARD)


@no_backward.register_fake
def _(grad_output, shape):
    return grad_output.new_empty(shape)


def _setup_context(ctx, inputs, output):
    hidden_states, router_logits, _, _, _, params = inputs
    ctx.shapes = [list(router_logits.shape)] + [list(p.shape) for p in params]


def _backward(ctx, grad_output):
    # every input a gradient may reach gets one that raises: the router's logits (a
    # router being tuned), the shared experts' parameters, not only the hidden states
    logits, *params = (no_backward(grad_output, shape) for shape in ctx.shapes)
    return no_backward(grad_output, list(grad_output.shape)), logits, None, None, None, params


# A formula that refuses when it runs: a model compiled outside no_grad (parameters that
# require grad, as after from_pretrained) compiles and runs forward; a backward fails.
moe_forward.register_autograd(_backward, setup_context=_setup_context)
