"""Data sets in their standard on-disk formats, read from --data-dir; `fetch` downloads them.

Layout under data_dir (what the official archives unpack to):

- cifar10: cifar-10-batches-py/{data_batch_1..5,test_batch} (python pickles: b"data", b"labels")
- cifar100: cifar-100-python/{train,test} (python pickles: b"data", b"fine_labels")
- movielens: ml-latest-small/ratings.csv (userId,movieId,rating,timestamp)
- shakespeare: shakespeare/{train,test}/*.json (LEAF: users, num_samples, user_data{x, y})
- digits: bundled with scikit-learn, nothing on disk.

CIFAR images are converted once into raw uint8 files in a `mosaic-cache` folder next to the pickles and
read from there row by row (`RowFile`, plain pread): the pixels stay in the kernel's page cache, shared
by every process on the host, instead of in each process (a memory map would not do: with large page-cache
folios one touched row maps megabytes into the process). Where that folder cannot be written, the
arrays are kept in memory (about 180 MB for CIFAR).
"""

from .cifar import RowFile, cache_dirs, load_cifar
from .common import DataMissing, Split, check_data, data_path, missing
from .digits import load_digits
from .fetch import FetchError, fetch, safe_extract_tar, safe_extract_zip
from .movielens import load_movielens
from .shakespeare import LEAF_LETTERS, encode_chars, load_shakespeare
from .synthetic import write_synthetic

__all__ = [
    "LEAF_LETTERS", "DataMissing", "FetchError", "RowFile", "Split", "cache_dirs", "check_data", "data_path",
    "encode_chars", "fetch",
    "load_cifar", "load_digits", "load_movielens", "load_shakespeare", "missing", "safe_extract_tar",
    "safe_extract_zip", "write_synthetic",
]
