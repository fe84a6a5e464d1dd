"""What a new user's CLI habits run into: a Hub folder of split files, a JSON array saved as .json, more datasets
than a page, and `--json --watch` in a script."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.sdk.test_cli import echo2


def test_a_folder_of_split_files_uploads_only_the_split_chosen(api, alice, tmp_path):
    """A Hub dataset's folder holds train-*.parquet beside test-*.parquet: both were merged into the dataset,
    `--split` or not (the held-out split trained on)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "main"
    folder.mkdir()
    pq.write_table(pa.table({"question": ["1+1", "2+2", "3+3"], "answer": ["2", "4", "6"]}),
                   folder / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"question": ["9+9"], "answer": ["18"]}), folder / "test-00000-of-00001.parquet")
    for args, items in ((["--split", "train"], 3), ([], 3), (["--split", "test"], 1)):
        result = echo2("datasets", "upload", f"gsm{items}{len(args)}", str(folder), *args, "--json", url=api.url,
                       key=alice.key)
        assert result.returncode == 0 and json.loads(result.stdout)["num_items"] == items, (args, result.stderr)
    wrong = echo2("datasets", "upload", "gsm-dev", str(folder), "--split", "dev", url=api.url, key=alice.key)
    assert wrong.returncode != 0 and "holds the splits test, train: choose one with --split" in wrong.stderr
    one_file = echo2("datasets", "upload", "one", str(folder / "test-00000-of-00001.parquet"), "--split", "train",
                     url=api.url, key=alice.key)
    assert one_file.returncode != 0 and "one file with no splits: leave out --split" in one_file.stderr


def test_a_json_array_saved_as_json_uploads_its_items(api, alice, tmp_path):
    """json.dump(items, f, indent=2) was read as JSON Lines: a JSON decoder error for every line."""
    items = tmp_path / "items.json"
    items.write_text(json.dumps([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}], indent=2))
    result = echo2("datasets", "upload", "arr", str(items), "--json", url=api.url, key=alice.key)
    assert result.returncode == 0 and json.loads(result.stdout)["num_items"] == 2, result.stderr
    items.write_text(json.dumps([1, 2], indent=2))
    bad = echo2("datasets", "upload", "nums", str(items), url=api.url, key=alice.key)
    assert bad.returncode != 0 and "item 1 of items.json is not an object" in bad.stderr


def test_datasets_list_says_when_there_are_more_than_it_shows(api, alice):
    for i in range(52):
        alice.client.datasets.create(f"ds{i}", [{"prompt": "x", "reference": "y"}])
    first = echo2("datasets", "list", url=api.url, key=alice.key)
    assert first.returncode == 0 and "(50 of 52; more with --offset 50)" in first.stdout, first.stderr
    rest = echo2("datasets", "list", "--offset", "50", url=api.url, key=alice.key)
    assert rest.returncode == 0 and "of 52" not in rest.stdout and len(rest.stdout.strip().splitlines()) == 3


def test_submit_json_watch_prints_only_the_json_on_stdout(api, alice):
    """With --watch, the progress lines and the report followed the job's JSON on stdout: a script's json.loads
    failed ("Extra data"). They go to stderr now."""
    def cancel_soon() -> None:
        for _ in range(100):
            page = alice.client.jobs.list()
            if page.items:
                alice.client.jobs.cancel(page.items[0].id)
                return
            time.sleep(0.2)

    threading.Thread(target=cancel_soon, daemon=True).start()
    result = echo2("jobs", "submit", "--model", "echo2:tiny", "--task", "arithmetic", "--steps", "2", "--json",
                   "--watch", url=api.url, key=alice.key, timeout=60)
    assert json.loads(result.stdout)["spec"]["name"] and "cancelled" in result.stderr
