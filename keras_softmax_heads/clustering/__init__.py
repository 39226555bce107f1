"""Word clustering for a two-level hierarchical softmax (HSM).

A two-level HSM factorises `p(w | x) = p(c(w) | x) * p(w | c(w), x)`, so
it needs a fixed assignment of every word to one of `C` clusters. This
package computes one with the four strategies of Chen, Grangier & Auli
(2016), `CLUSTERING_STRATEGIES`, and turns it into the static, padded
`[C, max_cluster_size]` layout an HSM layer gathers (`ClusterAssignment`).
NumPy / SciPy / scikit-learn only, deterministic given `seed`.

* `assignment`: the layout (`ClusterAssignment`, `hierarchical_layout`,
  `PAD_WORD`, `default_num_clusters`);
* `strategies`: `random_clusters`, `frequency_clusters`;
* `cooccurrence`: `cooccurrence_matrix`, `hellinger_embeddings`;
* `kmeans`: `kmeans_clusters` (plain or weighted, with a mass cap);
* `make`: `make_clusters`, the one entry point by strategy name.

Which strategy when, the mass cap and the serialisation format:
`docs/clustering.md`.

Example:

>>> import numpy as np
>>> from keras_softmax_heads import clustering
>>> counts = np.array([50, 20, 10, 8, 5, 4, 2, 1])
>>> layout = clustering.make_clusters("frequency", counts=counts, num_clusters=3)
>>> layout.cluster_of_word.tolist()
[0, 1, 2, 2, 2, 2, 2, 2]
>>> layout.cluster_words.tolist()
[[0, -1, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1], [2, 3, 4, 5, 6, 7]]

References:
    - Chen, Grangier, Auli. Strategies for Training Large Vocabulary Neural
      Language Models, ACL 2016. https://arxiv.org/abs/1512.04906
    - Lebret, Collobert. Word Embeddings through Hellinger PCA, EACL 2014.
      https://arxiv.org/abs/1312.5542
"""

from keras_softmax_heads.clustering.assignment import PAD_WORD
from keras_softmax_heads.clustering.assignment import ClusterAssignment
from keras_softmax_heads.clustering.assignment import default_num_clusters
from keras_softmax_heads.clustering.assignment import hierarchical_layout
from keras_softmax_heads.clustering.cooccurrence import cooccurrence_matrix
from keras_softmax_heads.clustering.cooccurrence import hellinger_embeddings
from keras_softmax_heads.clustering.kmeans import kmeans_clusters
from keras_softmax_heads.clustering.make import CLUSTERING_STRATEGIES
from keras_softmax_heads.clustering.make import make_clusters
from keras_softmax_heads.clustering.strategies import frequency_clusters
from keras_softmax_heads.clustering.strategies import random_clusters

__all__ = [
    "CLUSTERING_STRATEGIES",
    "PAD_WORD",
    "ClusterAssignment",
    "random_clusters",
    "frequency_clusters",
    "cooccurrence_matrix",
    "hellinger_embeddings",
    "kmeans_clusters",
    "hierarchical_layout",
    "default_num_clusters",
    "make_clusters",
]
