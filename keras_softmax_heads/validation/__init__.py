"""One place for argument checks, at the bottom of the package's layering.

`arguments`: Python values (integers, numbers within bounds, bools,
choices, seeds, embeddings); `arrays`: array-valued arguments (word
counts, integer arrays, token ids); `tensors`: tensor arguments (word ids
in range, floating dtypes) and what a loss that reduces by itself shares
with Keras' own (mask weights, integer targets, per-replica scaling). Every check names the argument and echoes the bad
value (`"... Received: seed=-1"`). This package imports nothing from the
rest of `keras_softmax_heads`.
"""

from keras_softmax_heads.validation.arguments import check_bool
from keras_softmax_heads.validation.arguments import check_choice
from keras_softmax_heads.validation.arguments import check_embedding_layer
from keras_softmax_heads.validation.arguments import check_input_embedding
from keras_softmax_heads.validation.arguments import check_int
from keras_softmax_heads.validation.arguments import check_number
from keras_softmax_heads.validation.arguments import check_positive
from keras_softmax_heads.validation.arguments import check_rate
from keras_softmax_heads.validation.arguments import check_seed
from keras_softmax_heads.validation.arguments import number_range
from keras_softmax_heads.validation.tensors import ACCUMULABLE_DTYPES
from keras_softmax_heads.validation.tensors import check_float_dtype
from keras_softmax_heads.validation.tensors import check_targets
from keras_softmax_heads.validation.tensors import graph_target_check
from keras_softmax_heads.validation.tensors import is_concrete
from keras_softmax_heads.validation.tensors import keras_integer_targets
from keras_softmax_heads.validation.tensors import keras_mask_weights
from keras_softmax_heads.validation.tensors import nan_if_invalid
from keras_softmax_heads.validation.tensors import per_replica
from keras_softmax_heads.validation.tensors import target_error_message
from keras_softmax_heads.validation.tensors import with_keras_mask_of
from keras_softmax_heads.validation.arrays import check_counts
from keras_softmax_heads.validation.arrays import check_ids
from keras_softmax_heads.validation.arrays import check_int_array
from keras_softmax_heads.validation.arrays import summarize
