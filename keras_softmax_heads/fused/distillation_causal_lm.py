"""keras-hub integration: `DistillationCausalLM` distils a frozen teacher
keras-hub `CausalLM` into a student `CausalLM` through `fit`, with
`linear_divergence` on both backbones' hidden states: neither model's
`[batch, seq, V]` logits are formed. See `docs/distillation.md`,
"keras-hub"."""

import keras
from keras import ops

from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.fused.causal_lm import FusedLossCausalLM
from keras_softmax_heads.fused.causal_lm import with_additional_losses
from keras_softmax_heads.fused.cross_entropy import linear_cross_entropy
from keras_softmax_heads.fused.distillation import check_divergence_options
from keras_softmax_heads.fused.distillation import linear_divergence
from keras_softmax_heads.fused.vocab_parallel import vocab_parallel_layout
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_number
from keras_softmax_heads.validation import keras_integer_targets


def output_projection(causal_lm):
    """`(kernel, kernel_transposed, logit_soft_cap)` of a keras-hub
    `CausalLM`: what its `backbone.token_embedding(h, reverse=True)`
    applies (`FusedLossCausalLM.fused_projection`, read from public
    attributes: the tied `embeddings` `[V, d]` or the untied
    `reverse_embeddings` `[d, V]`, and Gemma 2's final logit soft cap)."""
    return FusedLossCausalLM.fused_projection(causal_lm)


class DistillationCausalLM(keras.Model):
    """Distils a frozen teacher keras-hub `CausalLM` into a student one
    through `fit`, without either model's `[batch, seq, V]` logits.

    The model's `call` is the student's backbone (hidden states
    `[batch, seq, d_s]`); `compute_loss` (Keras' public hook) runs the
    teacher's backbone (inference mode, under `stop_gradient`) on the same
    inputs and applies `linear_divergence` to both hidden states with each
    model's output projection (`output_projection`: the token embedding,
    tied or not, and its final logit soft cap, e.g. Gemma 2's):

        loss = D(teacher || student) + cross_entropy_weight * CE(student, y)

    `D` one of `linear_divergence`'s divergences at `temperature`, `CE`
    the student's cross-entropy with the targets `y`
    (`linear_cross_entropy`, only when `cross_entropy_weight > 0`). The
    `sample_weight` (the padding mask) weights both; `ignore_index` drops
    the tokens whose target is that id. The teacher is frozen
    (`teacher.trainable = False`): its weights are not trained. The logs
    hold `loss` and `divergence` (and `cross_entropy` when mixed), the
    batch means. Train with `fit(x, y, sample_weight=...)` where `x` is
    what the backbones take (`{"token_ids", "padding_mask"}`; the same
    tokenizer for both: the same `V`) and `y` the next tokens (or None
    without cross-entropy and `ignore_index`). Generate with the
    `student`. Not serialisable as a whole: save the `student`.

    Args:
        student: a keras-hub `CausalLM` (its backbone is trained).
        teacher: a keras-hub `CausalLM` with the same vocabulary (any
            hidden size); frozen.
        divergence, beta, temperature, ignore_index, chunk_size,
        token_chunk_size, implementation: as in `linear_divergence` (the
            soft caps come from the models). A training step computes the
            divergence's gradient in its forward pass (over chunks of
            `token_chunk_size` tokens; `linear_divergence`'s
            `gradient_in_forward`), an evaluation step does not; the
            cross-entropy term likewise (`linear_cross_entropy`'s
            `gradient_in_forward`). Under a `keras.distribution` that shards
            the student's output matrix on V (JAX) the divergence and the
            cross-entropy are vocabulary-parallel (`linear_divergence`'s
            and `linear_cross_entropy`'s `vocab_parallel="auto"`), in
            evaluation too (the divergence then through the summed pass,
            whose unused gradient XLA removes under `jit`).
        reduction: `"mean"` (default) or `"sum"`, as in
            `linear_divergence`.
        cross_entropy_weight: float >= 0 (default 0): the weight of the
            student's cross-entropy with `y`.
        **kwargs: those of `keras.Model` (`name`, ...).

    Example (not run here: keras-hub is optional):

        distiller = ksh.fused.DistillationCausalLM(
            student=keras_hub.models.GemmaCausalLM.from_preset("gemma2_2b_en"),
            teacher=keras_hub.models.GemmaCausalLM.from_preset("gemma2_9b_en"),
            divergence="jsd", beta=0.5, temperature=2.0)
        distiller.compile(optimizer=keras.optimizers.AdamW(1e-5))
        distiller.fit(x, y, sample_weight=padding_mask)  # no [B, T, V] logits
        distiller.student.generate("Keras is")
    """

    def __init__(self, student, teacher, *, divergence="forward_kl", beta=0.5,
                 temperature=1.0, cross_entropy_weight=0.0, ignore_index=None,
                 reduction="mean", chunk_size=DEFAULT_CHUNK_SIZE,
                 token_chunk_size=None, implementation="auto", **kwargs):
        super().__init__(**kwargs)
        options = check_divergence_options(
            divergence=divergence, beta=beta, temperature=temperature,
            reduction=reduction, ignore_index=ignore_index,
            implementation=implementation)
        for key in ("student_soft_cap", "teacher_soft_cap", "teacher_gradient"):
            del options[key]
        check_choice("reduction", options["reduction"], ("mean", "sum"))
        self.divergence_options = options
        self.chunk_size = check_chunk_size(chunk_size)
        self.token_chunk_size = check_int("token_chunk_size", token_chunk_size,
                                          minimum=1, allow_none=True)
        self.cross_entropy_weight = check_number(
            "cross_entropy_weight", cross_entropy_weight, low=0)
        s_vocab = student.backbone.token_embedding.input_dim
        t_vocab = teacher.backbone.token_embedding.input_dim
        if s_vocab != t_vocab:
            raise ValueError(
                "The student and the teacher must share the vocabulary. Received: "
                f"student vocabulary_size={s_vocab}, teacher vocabulary_size={t_vocab}"
            )
        self.student = student
        self.teacher = teacher
        teacher.trainable = False
        self.divergence_tracker = keras.metrics.Mean(name="divergence")
        self.cross_entropy_tracker = None
        if self.cross_entropy_weight:
            self.cross_entropy_tracker = keras.metrics.Mean(name="cross_entropy")

    def call(self, inputs, training=None):
        """The student backbone's hidden states `[batch, seq, d_s]`."""
        return self.student.backbone(inputs, training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        options = dict(self.divergence_options)
        reduction = options.pop("reduction")
        y = keras_integer_targets(y)
        ignore_index = options.pop("ignore_index")
        teacher_hidden = ops.stop_gradient(self.teacher.backbone(x, training=False))
        s_kernel, s_transposed, s_cap = output_projection(self.student)
        t_kernel, t_transposed, t_cap = output_projection(self.teacher)
        loss = linear_divergence(
            y_pred, s_kernel, teacher_hidden, ops.stop_gradient(t_kernel), y,
            student_kernel_transposed=s_transposed,
            teacher_kernel_transposed=t_transposed, student_soft_cap=s_cap,
            teacher_soft_cap=t_cap, ignore_index=ignore_index,
            sample_weight=sample_weight, reduction=reduction,
            chunk_size=self.chunk_size, token_chunk_size=self.token_chunk_size,
            # No gradient is taken in evaluation: the tiled forward pass alone,
            # unless the student's output matrix is sharded on V, where only
            # the summed pass is vocabulary-parallel (the tiled one would
            # gather both matrices on every device); XLA then drops its
            # unused gradient work (`docs/distillation.md`).
            gradient_in_forward=None if training or vocab_parallel_layout(
                s_kernel, s_transposed) is not None else False, **options,
        )
        self.divergence_tracker.update_state(ops.mean(loss))
        if self.cross_entropy_weight:
            ce = linear_cross_entropy(
                y_pred, s_kernel, y, kernel_transposed=s_transposed,
                logit_soft_cap=s_cap, sample_weight=sample_weight,
                ignore_index=ignore_index, reduction=reduction,
                chunk_size=self.chunk_size,
                implementation=options["implementation"],
                # As the divergence: the gradient in the forward pass when
                # training (three products), the tiled forward otherwise.
                gradient_in_forward=bool(training),
                token_chunk_size=self.token_chunk_size if training else None,
            )
            self.cross_entropy_tracker.update_state(ops.mean(ce))
            loss = loss + self.cross_entropy_weight * ce
        return with_additional_losses(self, loss, reduction)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return {m.name: m.result() for m in self.metrics
                if m.name in ("loss", "divergence", "cross_entropy")}
