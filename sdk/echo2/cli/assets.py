"""What jobs read and produce: `echo2 datasets ...`, `echo2 tasks list`, `echo2 checkpoints download|export`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..dataset_files import FORMATS
from .common import Parser, connect, print_json
from .render import ProgressBar, table


def add_assets(groups: Any, conn: Parser) -> None:
    datasets = groups.add_parser("datasets", help="upload and list prompt datasets")
    dc = datasets.add_subparsers(dest="command", metavar="ACTION", required=True)
    upload = dc.add_parser("upload", parents=[conn], help="upload a dataset file of any size, in resumable parts",
                           description="JSONL (one item per line: plain prompts, or chat items with `messages`), or "
                                       "a Hugging Face dataset: a Parquet file or folder of them, an Arrow file, a "
                                       "folder written by save_to_disk (pip install 'echo2[datasets]'). Sent in "
                                       "parts with a progress bar; run it again to resume an interrupted upload. "
                                       "Every bad line is named with its number.")
    upload.add_argument("name", metavar="NAME")
    upload.add_argument("file", metavar="PATH", help="FILE.jsonl, FILE.parquet, FILE.arrow or a dataset folder")
    upload.add_argument("--format", choices=list(FORMATS), default="auto",
                        help="the file's format (default: from its name)")
    upload.add_argument("--split", help="the split of a saved DatasetDict, or of a folder of split files "
                        "(SPLIT-00000-of-00001.parquet: train, test, train_sft, ...): default train; where there "
                        "is none, name the split")
    upload.add_argument("--json", action="store_true")
    upload.set_defaults(func=_datasets_upload)
    dlist = dc.add_parser("list", parents=[conn], help="list your datasets")
    dlist.add_argument("--limit", type=int, default=50)
    dlist.add_argument("--offset", type=int, default=0)
    dlist.add_argument("--json", action="store_true")
    dlist.set_defaults(func=_datasets_list)

    tasks = groups.add_parser("tasks", help="registered task adapters")
    tc = tasks.add_subparsers(dest="command", metavar="ACTION", required=True)
    tlist = tc.add_parser("list", parents=[conn], help="list task adapters and their parameters")
    tlist.add_argument("--json", action="store_true")
    tlist.set_defaults(func=_tasks_list)

    ckpt = groups.add_parser("checkpoints", help="download or export trained checkpoints")
    cc = ckpt.add_subparsers(dest="command", metavar="ACTION", required=True)
    down = cc.add_parser("download", parents=[conn], help="download a job's checkpoint as an HF model folder")
    down.add_argument("job_id", metavar="JOB_ID")
    down.add_argument("dest", metavar="DIR")
    down.add_argument("--version", type=int,
                      help="weight version (default: the final checkpoint, else the latest)")
    down.add_argument("--overwrite", action="store_true", help="replace DIR if it is not empty")
    down.set_defaults(func=_checkpoints_download)
    export = cc.add_parser("export", parents=[conn], help="write a job's model as a plain Hugging Face folder",
                           description="Safetensors, config, tokenizer and generation config, as transformers and "
                                       "vLLM load a folder: the final version, a LoRA job merged into its base, or "
                                       "with --adapter its adapter alone.")
    export.add_argument("job_id", metavar="JOB_ID")
    export.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new or empty)")
    export.add_argument("--adapter", action="store_true", help="a LoRA job's adapter alone instead of the merged model")
    export.add_argument("--version", type=int, help="weight version (default: the final one, else the latest)")
    export.add_argument("--overwrite", action="store_true", help="replace DIR if it is not empty")
    export.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this Hugging Face model "
                        "repository (needs huggingface_hub: pip install 'echo2[hub]'; its token from HF_TOKEN)")
    export.add_argument("--private", action="store_true", help="create the Hub repository private")
    export.set_defaults(func=_checkpoints_export)


def _datasets_upload(args: argparse.Namespace) -> int:
    bar = ProgressBar(f"uploading {args.name}")
    with connect(args) as client:
        try:
            dataset = client.datasets.upload(args.name, args.file, format=args.format, split=args.split,
                                             progress=bar.update)
        finally:
            bar.close()
    if args.json:
        print_json(dataset)
    else:
        print(f"uploaded dataset {dataset.id} ({dataset.name}): {dataset.num_items} items, "
              f"keys {', '.join(dataset.keys) or '-'}")
    return 0


def _datasets_list(args: argparse.Namespace) -> int:
    with connect(args) as client:
        page = client.datasets.list(limit=args.limit, offset=args.offset)
    if args.json:
        print_json(page)
        return 0
    table(["ID", "NAME", "ITEMS", "KEYS", "CREATED"],
          [[d.id, d.name, d.num_items, ",".join(d.keys), d.created_at.strftime("%Y-%m-%d %H:%M")]
           for d in page.items])
    if page.next_offset is not None:
        print(f"({args.offset + len(page.items)} of {page.total}; more with --offset {page.next_offset})")
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


def _checkpoints_export(args: argparse.Namespace) -> int:
    with connect(args) as client:
        path = client.checkpoints.export(args.job_id, args.out, adapter=args.adapter, version=args.version,
                                         overwrite=args.overwrite)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    print(f"exported {', '.join(p.name for p in files)} ({size / 2**20:.1f} MiB) to {path}")
    if args.push_to_hub:
        from ..client import push_to_hub

        print(f"pushed to {push_to_hub(path, args.push_to_hub, private=args.private)}")
    return 0


def _checkpoints_download(args: argparse.Namespace) -> int:
    with connect(args) as client:
        path = client.checkpoints.download(args.job_id, args.dest, version=args.version,
                                           overwrite=args.overwrite)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    print(f"downloaded {len(files)} files ({size / 2**20:.1f} MiB) to {path}")
    return 0
