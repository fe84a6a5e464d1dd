"""What jobs read and produce: `echo2 datasets ...`, `echo2 tasks list`, `echo2 checkpoints download`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .common import Parser, connect, print_json
from .render import table


def add_assets(groups: Any, conn: Parser) -> None:
    datasets = groups.add_parser("datasets", help="upload and list prompt datasets")
    dc = datasets.add_subparsers(dest="command", metavar="ACTION", required=True)
    upload = dc.add_parser("upload", parents=[conn], help="upload a JSONL file (one JSON object per line)")
    upload.add_argument("name", metavar="NAME")
    upload.add_argument("file", metavar="FILE.jsonl")
    upload.add_argument("--json", action="store_true")
    upload.set_defaults(func=_datasets_upload)
    dlist = dc.add_parser("list", parents=[conn], help="list your datasets")
    dlist.add_argument("--json", action="store_true")
    dlist.set_defaults(func=_datasets_list)

    tasks = groups.add_parser("tasks", help="registered task adapters")
    tc = tasks.add_subparsers(dest="command", metavar="ACTION", required=True)
    tlist = tc.add_parser("list", parents=[conn], help="list task adapters and their parameters")
    tlist.add_argument("--json", action="store_true")
    tlist.set_defaults(func=_tasks_list)

    ckpt = groups.add_parser("checkpoints", help="download trained checkpoints")
    cc = ckpt.add_subparsers(dest="command", metavar="ACTION", required=True)
    down = cc.add_parser("download", parents=[conn], help="download a job's checkpoint as an HF model folder")
    down.add_argument("job_id", metavar="JOB_ID")
    down.add_argument("dest", metavar="DIR")
    down.add_argument("--version", type=int,
                      help="weight version (default: the final checkpoint, else the latest)")
    down.add_argument("--overwrite", action="store_true", help="replace DIR if it is not empty")
    down.set_defaults(func=_checkpoints_download)


def _datasets_upload(args: argparse.Namespace) -> int:
    with connect(args) as client:
        dataset = client.datasets.upload(args.name, args.file)
    if args.json:
        print_json(dataset)
    else:
        print(f"uploaded dataset {dataset.id} ({dataset.name}): {dataset.num_items} items, "
              f"keys {', '.join(dataset.keys) or '-'}")
    return 0


def _datasets_list(args: argparse.Namespace) -> int:
    with connect(args) as client:
        page = client.datasets.list()
    if args.json:
        print_json(page)
    else:
        table(["ID", "NAME", "ITEMS", "KEYS", "CREATED"],
              [[d.id, d.name, d.num_items, ",".join(d.keys), d.created_at.strftime("%Y-%m-%d %H:%M")]
               for d in page.items])
    return 0


def _tasks_list(args: argparse.Namespace) -> int:
    with connect(args) as client:
        tasks = client.tasks.list()
    if args.json:
        print(json.dumps([t.model_dump(mode="json") for t in tasks], indent=2))
    else:
        table(["TASK", "DATASET", "PARAMETERS", "DESCRIPTION"],
              [[t.name, "needed" if t.needs_dataset else "-",
                ",".join(t.params_schema.get("properties", {})) or "-", t.description] for t in tasks])
    return 0


def _checkpoints_download(args: argparse.Namespace) -> int:
    with connect(args) as client:
        path = client.checkpoints.download(args.job_id, args.dest, version=args.version,
                                           overwrite=args.overwrite)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    print(f"downloaded {len(files)} files ({size / 2**20:.1f} MiB) to {path}")
    return 0
