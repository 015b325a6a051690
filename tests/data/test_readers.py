import io
import json
import os
import pickle
import tarfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from loom.data.readers import ImageFolderSource, NumpySource, ParquetSource, WebDatasetSource, decode_image
from loom.errors import DataFileError


def plain(value):
    """Tensors, arrays and numpy scalars as Python values, to compare whole samples with ==."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.tolist())
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return value


def addresses(source):
    return [(s, i) for s, n in enumerate(source.lengths()) for i in range(n)]


def read_all(source, threads=1):
    with ThreadPoolExecutor(threads) as pool:
        return [plain(x) for x in pool.map(lambda a: source.read(*a), addresses(source))]


def pixels(seed, size=(5, 3)):
    """A small random RGB image as an HWC uint8 array and its PNG bytes."""
    array = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return array, buffer.getvalue()


def garbage(path, data=b"this is not what the name says" * 10):
    path.write_bytes(data)
    return str(path)


# ---------------------------------------------------------------- Parquet


@pytest.fixture
def parquet_files(tmp_path):
    paths = []
    for f, rows in enumerate((10, 7)):
        ids = list(range(100 * f, 100 * f + rows))
        table = pa.table({"id": ids, "x": [i / 2 for i in ids], "name": [f"row{i}" for i in ids]})
        paths.append(str(tmp_path / f"part{f}.parquet"))
        pq.write_table(table, paths[-1], row_group_size=4)
    return paths


def expected_rows(columns=("id", "x", "name")):
    ids = list(range(10)) + list(range(100, 107))
    full = [{"id": i, "x": i / 2, "name": f"row{i}"} for i in ids]
    return [{c: row[c] for c in columns} for row in full]


def test_parquet_lengths_and_rows(parquet_files, tmp_path):
    source = ParquetSource(str(tmp_path / "*.parquet"))
    assert source.shards == parquet_files
    assert source.lengths() == [10, 7] and len(source) == 17
    assert read_all(source) == expected_rows()
    assert isinstance(source.read(0, 0)["id"], np.integer)  # numeric columns come from numpy arrays
    assert read_all(ParquetSource(parquet_files, columns=["name", "id"])) == expected_rows(["name", "id"])
    with pytest.raises(IndexError):
        source.read(1, 7)


def test_parquet_decodes_each_row_group_once_when_read_in_order(parquet_files, monkeypatch):
    source = ParquetSource(parquet_files)
    decoded = []
    original = ParquetSource._decode
    monkeypatch.setattr(ParquetSource, "_decode", lambda self, s, g: decoded.append((s, g)) or original(self, s, g))
    read_all(source, threads=4)
    assert sorted(decoded) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


def test_parquet_threads_and_pickle(parquet_files):
    assert read_all(ParquetSource(parquet_files), threads=4) == expected_rows()
    source = ParquetSource(parquet_files)
    source.read(0, 3)
    copy = pickle.loads(pickle.dumps(source))
    assert copy.lengths() == [10, 7] and read_all(copy) == expected_rows()


def test_parquet_bad_files(parquet_files, tmp_path):
    bad = garbage(tmp_path / "bad.parquet")
    with pytest.raises(DataFileError, match="bad.parquet"):
        ParquetSource([parquet_files[0], bad]).lengths()
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        ParquetSource([parquet_files[0], str(tmp_path / "missing.parquet")])
    with pytest.raises(DataFileError, match="part0.parquet.*no column 'nope'"):
        ParquetSource(parquet_files, columns=["id", "nope"]).lengths()

    skipping = ParquetSource([parquet_files[0], bad], errors="skip")
    assert skipping.lengths() == [10, 0]
    assert [e.path for e in skipping.skipped] == [bad] and "bad.parquet" in str(skipping.skipped[0])

    source = ParquetSource(parquet_files)
    assert source.lengths() == [10, 7]
    os.remove(parquet_files[1])  # gone after counting: reading names it
    with pytest.raises(DataFileError, match="part1.parquet"):
        source.read(1, 0)


# ---------------------------------------------------------------- WebDataset


def write_tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.fixture
def shards(tmp_path):
    """Two tars of samples with png, cls, txt, json and npy members; returns (paths, expected samples)."""
    paths, expected = [], []
    for s, count in enumerate((3, 2)):
        members = []
        for i in range(count):
            key = f"images/{s}{i:03d}" if s else f"{s}{i:03d}"
            array, png = pixels(10 * s + i)
            vector = np.arange(i + 2, dtype=np.float32)
            npy = io.BytesIO()
            np.save(npy, vector)
            members += [
                (f"{key}.png", png),
                (f"{key}.cls", str(i).encode()),
                (f"{key}.txt", f"sample {key}".encode()),
                (f"{key}.json", json.dumps({"i": i}).encode()),
                (f"{key}.seg.npy", npy.getvalue()),
                (f"{key}.bin", b"\x00\x01"),
            ]
            expected.append({
                "__key__": key,
                "png": torch.from_numpy(array).permute(2, 0, 1),
                "cls": i,
                "txt": f"sample {key}",
                "json": {"i": i},
                "seg.npy": torch.from_numpy(vector),
                "bin": b"\x00\x01",
            })
        paths.append(write_tar(tmp_path / f"shard{s}.tar", members))
    return paths, [plain(x) for x in expected]


def test_webdataset_lengths_and_samples(shards, tmp_path):
    paths, expected = shards
    source = WebDatasetSource(str(tmp_path / "*.tar"))
    assert source.lengths() == [3, 2]
    assert read_all(source) == expected
    assert source.read(0, 0)["png"].dtype == torch.uint8

    raw = WebDatasetSource(paths, decode=False).read(1, 1)
    assert raw["__key__"] == "images/1001" and raw["cls"] == b"1" and raw["txt"] == b"sample images/1001"
    assert plain(decode_image(raw["png"])) == expected[4]["png"]


def test_webdataset_threads_and_pickle(shards):
    paths, expected = shards
    assert read_all(WebDatasetSource(paths), threads=4) == expected
    source = WebDatasetSource(paths)
    source.read(1, 0)
    copy = pickle.loads(pickle.dumps(source))
    assert read_all(copy, threads=4) == expected


def test_webdataset_bad_tars(shards, tmp_path):
    paths, _ = shards
    data = open(paths[0], "rb").read()
    with tarfile.open(paths[0]) as tar:
        members = tar.getmembers()
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(data[: members[7].offset_data + 10])  # inside a member's data
    with pytest.raises(DataFileError, match="truncated.tar"):
        WebDatasetSource([paths[1], str(truncated)]).lengths()
    at_header = garbage(tmp_path / "at_header.tar", data[: members[-1].offset])  # cut before a header
    with pytest.raises(DataFileError, match="at_header.tar.*truncated"):
        WebDatasetSource([at_header]).lengths()
    cut = members[6].offset
    mangled = garbage(tmp_path / "mangled.tar", data[:cut] + b"x" * 512 + data[cut + 512 :])  # a garbled header
    with pytest.raises(DataFileError, match="mangled.tar"):
        WebDatasetSource([mangled]).lengths()
    with pytest.raises(DataFileError, match="junk.tar"):
        WebDatasetSource([garbage(tmp_path / "junk.tar")]).lengths()
    with pytest.raises(FileNotFoundError, match="missing.tar"):
        WebDatasetSource([paths[0], str(tmp_path / "missing.tar")])

    skipping = WebDatasetSource([str(truncated), paths[1]], errors="skip")
    assert skipping.lengths() == [0, 2]
    assert len(skipping.skipped) == 1 and "truncated.tar" in str(skipping.skipped[0])

    broken = WebDatasetSource([write_tar(tmp_path / "broken.tar", [("a.png", b"not a png"), ("a.cls", b"1")])])
    assert broken.lengths() == [1]
    with pytest.raises(DataFileError, match=r"broken.tar.*a\.png"):
        broken.read(0, 0)


# ---------------------------------------------------------------- image folder


@pytest.fixture
def image_folder(tmp_path):
    root = tmp_path / "images"
    expected = []
    for label, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(3 - label):
            array, png = pixels(100 + 10 * label + i, size=(4 + i, 2))
            (root / name / f"{i}.png").write_bytes(png)
            expected.append((str(root / name / f"{i}.png"), array, png, label))
    (root / "dog" / "notes.txt").write_text("not an image")
    return root, expected


def test_image_folder_lengths_and_reads(image_folder):
    root, expected = image_folder
    source = ImageFolderSource(root)
    assert source.classes == ["cat", "dog"] and source.lengths() == [5]
    assert [p for p, _ in source.samples] == [e[0] for e in expected]
    for i, (_, array, _, label) in enumerate(expected):
        image, got_label = source.read(0, i)
        assert image.dtype == torch.uint8 and torch.equal(image, torch.from_numpy(array).permute(2, 0, 1))
        assert got_label == label
    assert [ImageFolderSource(root, decode=False).read(0, i) for i in range(5)] == [(e[2], e[3]) for e in expected]

    assert read_all(ImageFolderSource(root), threads=4) == read_all(source)
    copy = pickle.loads(pickle.dumps(source))
    assert read_all(copy) == read_all(source)


def test_image_folder_errors(image_folder, tmp_path):
    root, expected = image_folder
    Image.new("RGB", (2, 2)).save(root / "dog" / "zz.png")
    with open(root / "dog" / "zz.png", "r+b") as file:
        file.seek(20)
        file.write(b"\xff" * 40)  # keep the signature, break the header chunk
    source = ImageFolderSource(root)
    with pytest.raises(DataFileError, match="zz.png"):
        source.read(0, len(expected))
    with pytest.raises(DataFileError, match="<bytes>"):
        decode_image(b"garbage")

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        ImageFolderSource(tmp_path / "empty")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(expected[0][2])
    with pytest.raises(FileNotFoundError, match="flat"):
        ImageFolderSource(tmp_path / "flat")


# ---------------------------------------------------------------- NumPy


@pytest.fixture
def numpy_files(tmp_path):
    rows = np.arange(15, dtype=np.int64).reshape(5, 3)
    labels = np.array([3, 1, 4, 1], dtype=np.int32)
    features = np.linspace(0, 1, 8, dtype=np.float32).reshape(4, 2)
    np.save(tmp_path / "a.npy", rows)
    np.savez(tmp_path / "b.npz", features=features, labels=labels)
    return [str(tmp_path / "a.npy"), str(tmp_path / "b.npz")], rows, features, labels


def test_numpy_lengths_and_rows(numpy_files):
    paths, rows, features, labels = numpy_files
    source = NumpySource(paths)
    assert source.lengths() == [5, 4]
    assert source.read(0, 2).dtype == torch.int64 and source.read(0, 2).tolist() == [6, 7, 8]
    row = source.read(1, 3)
    assert row["labels"].item() == 1 and row["features"].tolist() == features[3].tolist()
    assert [NumpySource(paths[1:], key="labels").read(0, i).item() for i in range(4)] == labels.tolist()

    sequential = read_all(source)
    assert read_all(NumpySource(paths), threads=4) == sequential
    copy = pickle.loads(pickle.dumps(source))
    assert read_all(copy) == sequential


def test_numpy_bad_files(numpy_files, tmp_path):
    paths, *_ = numpy_files
    bad = garbage(tmp_path / "bad.npy")
    with pytest.raises(DataFileError, match="bad.npy"):
        NumpySource([paths[0], bad]).lengths()
    with pytest.raises(DataFileError, match="bad.npz"):
        NumpySource([garbage(tmp_path / "bad.npz", b"PK\x03\x04 a broken zip")]).lengths()
    np.savez(tmp_path / "ragged.npz", a=np.zeros(3), b=np.zeros(4))
    with pytest.raises(DataFileError, match="ragged.npz.*first dimension"):
        NumpySource([str(tmp_path / "ragged.npz")]).lengths()
    with pytest.raises(DataFileError, match="b.npz.*no array 'nope'"):
        NumpySource(paths[1:], key="nope").lengths()

    np.save(tmp_path / "scalar.npy", np.float32(1))
    with pytest.raises(DataFileError, match="scalar.npy.*with rows"):
        NumpySource([str(tmp_path / "scalar.npy")]).lengths()

    data = open(paths[0], "rb").read()
    short = garbage(tmp_path / "short.npy", data[: len(data) - 16])  # header promises more rows than there are
    skipping = NumpySource([short, paths[0]], errors="skip")
    assert skipping.lengths() == [0, 5]
    assert [e.path for e in skipping.skipped] == [short]
