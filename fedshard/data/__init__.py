"""The paper's data sets and their splits over simulated clients (paper, Sec. 4.1).

- :mod:`~fedshard.data.registry` - names, :class:`DatasetInfo`, where files are looked for.
- :mod:`~fedshard.data.partition` - Dir(α·p) and Pachinko splits (pure numpy).
- :mod:`~fedshard.data.images`, :mod:`~fedshard.data.image_files` - image arrays, per-image
  standardization, the idx / CIFAR-pickle / TinyImageNet readers.
- :mod:`~fedshard.data.shakespeare` - LEAF's Shakespeare JSON, next-character samples.
- :mod:`~fedshard.data.plays`, :mod:`~fedshard_lab.shakespeare_build` - the plays' text
  parsed into speaking roles, and LEAF's data set built from it
  (``python -m fedshard_lab.shakespeare_build DATA_DIR``).
- :mod:`~fedshard.data.fetch` - Fashion-MNIST's official files downloaded once: checksummed,
  renamed into place, one process at a time.
- :mod:`~fedshard.data.loading` - :func:`load_partition` and :func:`load_test_set`.
"""

from fedshard.data.images import ImageDataset, per_image_standardization
from fedshard.data.loading import (
    clear_cache,
    held_out_indices,
    load_held_out,
    load_partition,
    load_test_set,
)
from fedshard.data.partition import dirichlet_partition, pachinko_partition, partition_sizes
from fedshard.data.registry import (
    DATASETS,
    DataFormatError,
    DataNotFoundError,
    DatasetInfo,
    dataset_info,
    default_cache_dir,
)
from fedshard.data.shakespeare import VOCAB_SIZE, ShakespeareDataset

__all__ = [
    "DATASETS",
    "VOCAB_SIZE",
    "DataFormatError",
    "DataNotFoundError",
    "DatasetInfo",
    "ImageDataset",
    "ShakespeareDataset",
    "clear_cache",
    "dataset_info",
    "default_cache_dir",
    "dirichlet_partition",
    "held_out_indices",
    "load_held_out",
    "load_partition",
    "load_test_set",
    "pachinko_partition",
    "partition_sizes",
    "per_image_standardization",
]
