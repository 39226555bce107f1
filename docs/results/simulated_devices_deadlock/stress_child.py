"""The model-parallel test's child with longer evaluation splits and a wider
LSTM (device steps slower than their dispatch: predict runs ahead)."""
import sys
sys.path.insert(0, "tests")  # run from the repository root
import test_vocabulary_parallel_training as t
t.TINY_DATA.update(num_valid_tokens=3000, num_test_tokens=3001)
_config = t._config
t._config = lambda head, **kw: _config(head, **{"embedding_dim": 256, "hidden_size": 256, **kw})
t.child()
