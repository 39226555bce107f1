"""Fused linear + cross-entropy: the exact loss of `softmax(g(h W + b))`
without the `[N, V]` logits, from a model's final hidden states.

Modules:

* `cross_entropy`: the function `linear_cross_entropy`, its per-token terms
  (`token_terms`), reductions (`reduce_loss`) and option checks.
* `loss`: `LinearCrossEntropy`, the function as a `keras.losses.Loss`.
* `vocab_parallel`: the vocabulary-parallel form on JAX
  (`vocab_parallel_layout`, `vocab_parallel_stats`) and `pointwise_stats`,
  the one place that chooses it.
* `causal_lm`: the keras-hub integration, `fused_causal_lm(CausalLMClass)`
  and its mixin `FusedLossCausalLM`.
* `pallas_cross_entropy`: the Pallas GPU kernels of the per-token
  statistics (`pallas_pointwise_stats`; JAX on a GPU, interpret mode
  elsewhere), which `vocab_parallel.single_device_stats` picks.
* `token_scores`: `linear_token_scores`, per-token log-probabilities and
  entropies without the logits (`docs/token_statistics.md`).
* `causal_lm_scores`: `causal_lm_token_scores`, the same for token
  sequences under a keras-hub `CausalLM`.

See `docs/chunked.md`, "Fused linear + cross-entropy from hidden states".
"""

from keras_softmax_heads.fused.causal_lm import FusedLossCausalLM
from keras_softmax_heads.fused.causal_lm import fused_causal_lm
from keras_softmax_heads.fused.cross_entropy import REDUCTIONS
from keras_softmax_heads.fused.cross_entropy import linear_cross_entropy
from keras_softmax_heads.fused.loss import LinearCrossEntropy
from keras_softmax_heads.fused.vocab_parallel import vocab_parallel_layout
from keras_softmax_heads.fused.vocab_parallel import vocab_parallel_stats
from keras_softmax_heads.validation import ACCUMULABLE_DTYPES
from keras_softmax_heads.fused.pallas_cross_entropy import pallas_pointwise_stats

__all__ = [
    "ACCUMULABLE_DTYPES",
    "FusedLossCausalLM",
    "LinearCrossEntropy",
    "REDUCTIONS",
    "fused_causal_lm",
    "linear_cross_entropy",
    "vocab_parallel_layout",
    "vocab_parallel_stats",
    "pallas_pointwise_stats",
]
from keras_softmax_heads.fused.distillation import linear_divergence  # noqa: E402

__all__ += ["linear_divergence"]
from keras_softmax_heads.fused.distillation_causal_lm import DistillationCausalLM  # noqa: E402

__all__ += ["DistillationCausalLM"]

from keras_softmax_heads.fused.causal_lm_scores import causal_lm_token_scores  # noqa: E402
from keras_softmax_heads.fused.token_scores import linear_token_scores  # noqa: E402

__all__ += ["causal_lm_token_scores", "linear_token_scores"]
