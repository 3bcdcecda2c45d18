"""The datasets dynaseq's configs, tests and benchmarks name, and where they live.

Shipped configs name their files relative to the **data root** as ``$DATA/<dataset>/<file>``
(e.g. ``$DATA/multi30k/train.en.gz``). The root is ``$DYNASEQ_DATA`` when that is set;
otherwise ``data/`` when it exists, else ``../shared/data`` when it exists (this repository's
machines), else ``data/``. Any other path is used as it is. :data:`DATASETS` lists, per
dataset, where to get it and the sha256 of each file, which ``dynaseq data check`` verifies
and ``docs/data.md`` shows.

Example::

    resolve_data_path("$DATA/wikitext-2/train.txt")  # PosixPath('../shared/data/wikitext-2/train.txt')
    check_data(data_root())                           # [FileCheck(...), ...]
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import sha256_file, user_path

#: The environment variable that names the data root.
DATA_ENV = "DYNASEQ_DATA"
#: A path that starts with this is relative to the data root.
DATA_PREFIX = "$DATA/"
#: Where the root is looked for when ``DYNASEQ_DATA`` is unset, in order.
DEFAULT_ROOTS = ("data", "../shared/data")


@dataclass(frozen=True)
class Dataset:
    """One dataset: its directory under the root, what it is, where to get it, its terms of
    use, and ``files``: path under the dataset's directory -> sha256 (hex)."""

    name: str
    description: str
    upstream: str
    license: str
    files: Mapping[str, str]


#: Every dataset the shipped configs, tests and benchmarks use.
DATASETS: dict[str, Dataset] = {
    "wikitext-2": Dataset(
        "wikitext-2", "WikiText-2 (v1, tokenized), word-level language modelling",
        "https://github.com/pytorch/examples/tree/main/word_language_model/data/wikitext-2",
        "CC BY-SA (Merity et al. 2016)",
        {
        "test.txt": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
        "train.txt": "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
        "valid.txt": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
        }),
    "multi30k": Dataset(
        "multi30k", "Multi30k task 1 (en, de, fr), translation; raw .gz and the upstream lower-cased tokenized files",
        "https://github.com/multi30k/dataset (data/task1/raw, data/task1/tok)",
        "non-commercial research use (Flickr terms); cite Elliott et al. 2016, 2017",
        {
        "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
        "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
        "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
        "tok/test_2016_flickr.lc.norm.tok.de": "c6a33d39d48f9f510de147651316cd9d918e09ad0219df734a2f16b6baccacc4",
        "tok/test_2016_flickr.lc.norm.tok.en": "5b7f32627cf99eced828311b955dae9800bb52bc8b91cf8b6526829e605b29d2",
        "tok/test_2016_flickr.lc.norm.tok.fr": "1463bd5960f9bfe098ec3cd752d3df0c49c84dc646fb518964a29232658cd836",
        "tok/train.lc.norm.tok.de": "cb5a23529b65ec2061f1dc446192a9c37382b63cc75f81a0be59d34894b3a505",
        "tok/train.lc.norm.tok.en": "08925f8e0572bcd5a006702fc5fe20e2d77c6917d4eebd576fc20de6693c2119",
        "tok/train.lc.norm.tok.fr": "8fa41bb718412bcb7c5dfa58603842810a01543eae86a51279f9886b901266e1",
        "tok/val.lc.norm.tok.de": "97232bd273eceb7207f689527386a97e4be2616b18ada47576bdaf96c8ae1f00",
        "tok/val.lc.norm.tok.en": "46573ce391ae227f1c72f873392436a20ef18e0a6d518098cfbd70b77c8572ec",
        "tok/val.lc.norm.tok.fr": "b303e301aa21fe7822a846b2b3fb2d5a1121ec807cd5b1d006fb7b2b5507168a",
        "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
        "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
        "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
        "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
        "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
        "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
        }),
    "glue": Dataset(
        "glue", "GLUE SST-2 and CoLA in the layout of GLUE's download_glue_data.py",
        "https://gluebenchmark.com/tasks (download_glue_data.py writes glue_data/<TASK>/)",
        "each source dataset's own terms (CoLA: Warstadt et al.; SST-2: Socher et al. 2013)",
        {
        "CoLA/dev.tsv": "8c013e21dc39957cac37378d87bebe225b694a0d5fe13eded66c2856628833fd",
        "CoLA/in_domain_dev.tsv": "2dc8ae5dafcf3a46fa4d4215cd4882c7d05c17e5a7696de4f9c32b29286a530c",
        "CoLA/out_of_domain_dev.tsv": "a95f976e24a27e81d287f224bc07672813b703c3faa399bfdfada5b976854a11",
        "CoLA/test.tsv": "3b4df85f7a9a0633574b38d181e18090ac961a24b18fb6bcd74999ddea8ad0b8",
        "CoLA/train.tsv": "cb368ebeb9f27d7ad03720d27ddc95687a311bdb100781a2fe59a5f5b1bc0624",
        "SST-2/dev.tsv": "54a9c12c77e402fc14d6a66a506f24d999f596b0176eb777c972cccc2f9cc4b0",
        "SST-2/test.tsv": "69a938605609b3e6663b4487918fe1565eb293734e6e520d0366d1d412fd2a13",
        "SST-2/train.tsv": "48eac26399f8456935f81dd9e3a745c1430adb6c62e233ccfe22db4a0d15d1d1",
        }),
}


def data_root(environ: Mapping[str, str] | None = None) -> Path:
    """The data root: ``$DYNASEQ_DATA``, else the first of :data:`DEFAULT_ROOTS` that is a
    directory, else ``data``."""
    env = os.environ if environ is None else environ
    if env.get(DATA_ENV):
        return Path(env[DATA_ENV])
    return next((Path(p) for p in DEFAULT_ROOTS if Path(p).is_dir()), Path(DEFAULT_ROOTS[0]))


def _root_origin(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    if env.get(DATA_ENV):
        return f"{DATA_ENV}={env[DATA_ENV]}"
    state = "empty" if DATA_ENV in env else "unset"  # an empty one is not used either
    return f"{DATA_ENV} {state}, no {' or '.join(p + '/' for p in DEFAULT_ROOTS)} here"


def resolve_data_path(path: str | Path, environ: Mapping[str, str] | None = None) -> Path:
    """``path`` with a leading ``$DATA/`` replaced by the data root, a leading ``~`` by the
    home directory (:func:`~dynaseq.core.files.user_path`); other paths unchanged.

    Raises:
        DynaseqError: a ``$DATA/`` file that does not exist under the root, in one line
            naming the dataset, the root, ``docs/data.md`` and ``dynaseq data check``.
    """
    text = str(path)
    if not text.startswith(DATA_PREFIX):
        return user_path(path)
    rel = text[len(DATA_PREFIX):]
    root = data_root(environ)
    resolved = root / rel
    if not resolved.exists():
        name = rel.split("/", 1)[0]
        known = DATASETS.get(name)
        where = f"get it from {known.upstream}" if known else "see docs/data.md"
        origin = "" if root.is_dir() else f" ({_root_origin(environ)})"
        raise DynaseqError(
            f"dataset {name} is missing: {resolved} not found under the data root "
            f"{root}{origin}; {where} (docs/data.md), set {DATA_ENV} to the folder that holds "
            f"it, and run `dynaseq data check` to verify")
    return resolved


@dataclass(frozen=True)
class FileCheck:
    """One file of :data:`DATASETS` under a root: ``status`` is ``ok``, ``missing`` or
    ``mismatch`` (present, other sha256)."""

    dataset: str
    path: Path
    status: str


def check_data(root: Path, names: list[str] | None = None) -> list[FileCheck]:
    """Each file of the named datasets (default: all) under ``root``, checked against its
    sha256.

    Raises:
        DynaseqError: an unknown dataset name, or a file that exists but cannot be read.
    """
    unknown = sorted(set(names or []) - set(DATASETS))
    if unknown:
        raise DynaseqError(f"unknown dataset {unknown[0]}; known: {', '.join(DATASETS)}")
    checks = []
    for name in names or list(DATASETS):
        for rel, sha in DATASETS[name].files.items():
            path = root / name / rel
            if not path.is_file():
                checks.append(FileCheck(name, path, "missing"))
                continue
            try:
                ok = sha256_file(path) == sha
            except OSError as e:
                raise DynaseqError(f"cannot read {path}: {e.strerror or e}") from None
            checks.append(FileCheck(name, path, "ok" if ok else "mismatch"))
    return checks
