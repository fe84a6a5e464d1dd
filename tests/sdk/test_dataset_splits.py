"""A Hugging Face dataset folder whose splits are not named train/test/validation/valid/dev.

Hub datasets often name their splits otherwise (HuggingFaceH4/ultrachat_200k: train_sft, test_sft, train_gen,
test_gen; the files `train_sft-00000-of-00003.parquet`, ...). `echo2 datasets upload NAME FOLDER` (and
`client.datasets.upload`) read a folder's split from its file names but knew only five split names: for any other
they saw "no split files", so without --split they merged every split (the held-out test split uploaded for
training, which the split handling exists to prevent), and with --split they refused the split the user named."""

from __future__ import annotations

import json

import pytest
from echo2.dataset_files import as_jsonl

from tests.sdk.test_cli import echo2

SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the SDK reads the folder


def _hub_folder(tmp_path, suffix: str = "-00000-of-00001"):  # type: ignore[no-untyped-def]
    """train_sft and test_sft splits, as Hub shards (or, with no suffix, one file a split)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2=", "3+3="], "answer": ["2", "4", "6"]}),
                   folder / f"train_sft{suffix}.parquet")
    pq.write_table(pa.table({"prompt": ["9+9="], "answer": ["18"]}), folder / f"test_sft{suffix}.parquet")
    return folder


@SQLITE
def test_a_split_named_otherwise_than_train_or_test_can_be_chosen(alice, tmp_path):
    folder = _hub_folder(tmp_path)
    try:
        dataset = alice.client.datasets.upload("sft-train", folder, split="train_sft")
    except Exception as exc:  # noqa: BLE001 - the refusal is the defect
        pytest.fail(f"--split train_sft of a folder holding train_sft-*.parquet and test_sft-*.parquet was refused: "
                    f"{type(exc).__name__}: {exc}")
    assert dataset.num_items == 3


@SQLITE
def test_a_folder_of_splits_named_otherwise_is_not_merged_into_one_dataset(alice, tmp_path):
    folder = _hub_folder(tmp_path)
    try:
        dataset = alice.client.datasets.upload("sft-all", folder)
    except Exception as exc:  # noqa: BLE001 - asked to choose a split: what should happen
        assert "train_sft" in str(exc) and "test_sft" in str(exc), exc
        return
    pytest.fail(f"the train_sft and test_sft splits were merged into one dataset of {dataset.num_items} items: the "
                "held-out test split is uploaded for training")


@SQLITE
def test_the_cli_asks_which_split_of_a_folder_without_a_train_split(api, alice, tmp_path):
    folder = _hub_folder(tmp_path)
    asked = echo2("datasets", "upload", "sft", str(folder), url=api.url, key=alice.key)
    assert asked.returncode != 0 and "holds the splits test_sft, train_sft: choose one with --split" in asked.stderr
    chosen = echo2("datasets", "upload", "sft", str(folder), "--split", "test_sft", url=api.url, key=alice.key)
    assert chosen.returncode == 0, chosen.stderr
    assert [d.num_items for d in alice.client.datasets.list().items] == [1]


def test_one_file_per_split_named_otherwise_is_not_merged(tmp_path):
    """train_sft.parquet beside test_sft.parquet (`dataset[split].to_parquet(f"{split}.parquet")`) read as files of
    no split: merged, the held-out split uploaded for training (review finding). The user chooses now."""
    with pytest.raises(ValueError, match="holds the splits test_sft, train_sft: choose one with --split"):
        as_jsonl(_hub_folder(tmp_path, suffix=""), "parquet")


def test_a_split_of_one_file_named_otherwise_can_be_chosen(tmp_path):
    out, _ = as_jsonl(_hub_folder(tmp_path, suffix=""), "parquet", split="train_sft")
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["1+1=", "2+2=", "3+3="]
