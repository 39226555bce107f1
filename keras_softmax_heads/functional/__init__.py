"""Pure functions on scores, shared by the heads (any Keras backend).

* `outputs`: output functions in log space (`soft_cap`,
  `log_sigmoid_scores`, `log_sigsoftmax`, `log_sigmoid_output_scores`,
  `log_relu_output_scores`);
* `plif_kernels`: PLIF (Ganea et al. 2019), `plif` and the fused
  `plif_log_likelihood` with their custom gradients (design:
  `docs/plif.md`), and its pieces for a kernel that differentiates PLIF
  itself (`plif_tables`, `plif_scores`, `plif_slope_histograms`,
  `plif_raw_slope_gradient`, and `scan_row_tiles`, PLIF's tiles);
* `tabulated`: `interpolate_table`, a tabulated function interpolated
  linearly;
* `dispatch`: the package's only backend-specific code, one dispatch
  function each (`scan_tiles`, `knot_histogram` with its paths chosen by
  platform: `histogram_method`,
  `sorted_knot_histogram`, `spread_knot_histogram`; `lookup` and
  `upstream_gradient` are imported
  from `functional.dispatch`);
* `plif_pallas`: `pallas_knot_histogram`, the slope histogram as a Pallas
  kernel, and `pallas_ll_gradient`, `plif_log_likelihood`'s backward tile
  as one (JAX; imported from `functional.plif_pallas`, it imports JAX).

Every public name is importable from `keras_softmax_heads.functional`.
"""

from keras_softmax_heads.functional.dispatch import knot_histogram
from keras_softmax_heads.functional.dispatch import scan_tiles
from keras_softmax_heads.functional.outputs import log_relu_output_scores
from keras_softmax_heads.functional.outputs import log_sigmoid_output_scores
from keras_softmax_heads.functional.outputs import log_sigmoid_scores
from keras_softmax_heads.functional.outputs import log_sigsoftmax
from keras_softmax_heads.functional.outputs import soft_cap
from keras_softmax_heads.functional.plif_kernels import TILE_ELEMENTS
from keras_softmax_heads.functional.plif_kernels import check_knot_bound
from keras_softmax_heads.functional.plif_kernels import check_raw_slopes
from keras_softmax_heads.functional.plif_kernels import plif
from keras_softmax_heads.functional.plif_kernels import plif_identity_raw_slope
from keras_softmax_heads.functional.plif_kernels import plif_log_likelihood
from keras_softmax_heads.functional.plif_kernels import plif_raw_slope_gradient
from keras_softmax_heads.functional.plif_kernels import plif_reference
from keras_softmax_heads.functional.plif_kernels import plif_scores
from keras_softmax_heads.functional.plif_kernels import plif_slope_histograms
from keras_softmax_heads.functional.plif_kernels import plif_tables
from keras_softmax_heads.functional.plif_kernels import scan_row_tiles
from keras_softmax_heads.functional.tabulated import interpolate_table
from keras_softmax_heads.functional.dispatch import histogram_method
from keras_softmax_heads.functional.dispatch import sorted_knot_histogram
from keras_softmax_heads.functional.dispatch import spread_knot_histogram
