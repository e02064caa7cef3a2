"""`paths report`: every chart is there and decodes as an image, the tables hold the run's numbers,
a takeover is on the claims timeline, it reads S3 runs, and bad input is one line with exit 1."""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import time
from html.parser import HTMLParser

import pytest
from click.testing import CliRunner
from PIL import Image

from cli.main import main
from compose.report import fmt
from paths.train_config import load_config
from paths.work.claims import claim
from paths.work.train import train
from sharding.shard import ShardOptions, shard
from tests.sharding.conftest import docs, make_run, write_jsonl

TINY = load_config(None, ["seq_len=32", "batch_size=4", "warmup_steps=1"], steps=4, checkpoint_every=0)


class _Tables(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables, self.cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self.cell)
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def tables(page: str) -> list[list[list[str]]]:
    """Every table of the page as rows of cell texts (header row first)."""
    parser = _Tables()
    parser.feed(page)
    return parser.tables


def decoded(path: str) -> tuple[int, int]:
    with Image.open(path) as im:
        im.load()  # decodes every pixel: a truncated PNG fails here
        return im.size


def trained_run(url: str, tokenizer_dir: str, tmp_path, options: dict | None = None):
    """16 paths, a hash-routed dataset, p01-02 claimed by worker-a whose lease expires and is
    taken over by worker-b, which trains it; p02-03 trained by worker-c; an eval of both."""
    run = make_run(url, tokenizer_dir, 2, options)
    shard(run, ShardOptions(dataset="lm", inputs=[write_jsonl(str(tmp_path / "in" / "a.jsonl"), docs(240))], id_field="id", holdout=0.1), storage_options=options)
    claim(run, ["p01-02"], ttl=0.05, worker="worker-a")
    time.sleep(0.2)  # expired, and past the takeover grace
    for path, worker in (("p01-02", "worker-b"), ("p02-03", "worker-c")):
        lease = claim(run, [path], ttl=60, worker=worker)
        assert lease.path == path
        train(run, path, "lm", "lm", TINY, lease, show_progress=False)
    return run


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_report_charts_tables_and_takeover(backend, tmp_path, tokenizer_dir, request):
    if backend == "s3":
        server, bucket = request.getfixturevalue("seaweed"), request.getfixturevalue("bucket")
        url, options = f"s3://{bucket}/report-{tmp_path.name}", server.storage_options
        for k, v in server.env().items():
            request.getfixturevalue("monkeypatch").setenv(k, v)
    else:
        url, options = str(tmp_path / "run"), None
    run = trained_run(url, tokenizer_dir, tmp_path, options)
    ev = CliRunner().invoke(main, ["eval", url, "--dataset", "lm", "--model", "base", "--model", "path:p01-02", "--max-tokens", "2000", "--json"])
    assert ev.exit_code == 0, ev.output
    out = str(tmp_path / "report")
    result = CliRunner().invoke(main, ["report", url, "--out", out])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}/index.html (3 charts: loss.png, routing.png, claims.png)" in result.output

    for name in ("loss", "routing", "claims"):
        w, h = decoded(os.path.join(out, f"{name}.png"))
        assert w > 300 and h > 150, (name, w, h)
    page = open(os.path.join(out, "index.html"), encoding="utf-8").read()
    embedded = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(embedded) == 3  # self-contained: each chart inside the page too
    for data in embedded:
        with Image.open(io.BytesIO(base64.b64decode(data))) as im:
            im.load()

    text = html.unescape(page)
    # the training table: each trained unit's last loss and tokens, as in its metrics
    for path in ("p01-02", "p02-03"):
        last = json.loads(run.store.read(f"work/{path}/metrics.jsonl").decode().splitlines()[-1])
        assert f"<td>{path}</td><td>lm</td><td>lm</td><td class=num>4</td><td class=num>{fmt(last['tokens'])}</td><td class=num>{fmt(last['loss'])}</td>" in text
    # routing: the dataset's documents, summed from its manifest
    manifest = json.loads(run.store.read("data/lm/manifest.json"))
    docs_total = sum(e["train_docs"] for e in manifest["paths"].values())
    assert f"<td>lm</td><td>documents</td><td>hash</td><td class=num>16</td><td class=num>{fmt(docs_total)}</td>" in text
    # the eval table: every number of the eval file, under its model and shard
    table = json.loads(ev.output)["table"]
    shown = next(t for t in tables(page) if t[0][0] == "model")
    header = shown[0]
    assert {row[0]: dict(zip(header[1:], row[1:])) for row in shown[1:]} == {m: {c: fmt(v) for c, v in row.items()} for m, row in table.items()}
    # the takeover: worker-a's lease expired and worker-b took p01-02 over
    assert "Leases that expired and were taken over" in text and "<td>p01-02</td><td>worker-a</td><td class=num>1</td>" in text
    assert "no composed model" in text  # what the run lacks is said


def test_report_bad_input(tmp_path, tokenizer_dir):
    runner = CliRunner()
    not_a_run = str(tmp_path / "empty")
    os.makedirs(not_a_run)
    result = runner.invoke(main, ["report", not_a_run, "--out", str(tmp_path / "r0")])
    assert result.exit_code == 1 and "is not a paths run (no run.json)" in result.output
    assert not os.path.exists(tmp_path / "r0")

    run = make_run(str(tmp_path / "run"), tokenizer_dir, 1)
    out = str(tmp_path / "r1")
    result = runner.invoke(main, ["report", run.url, "--out", out])
    assert result.exit_code == 1 and "has nothing trained yet: wrote" in result.output
    assert os.path.exists(os.path.join(out, "index.html"))  # what exists is still written
    assert "nothing trained yet" in open(os.path.join(out, "index.html")).read()

    before = os.listdir(out)
    result = runner.invoke(main, ["report", run.url, "--out", out])
    assert result.exit_code == 1 and "already exists: pass --overwrite" in result.output
    assert os.listdir(out) == before
    assert len(result.output.strip().splitlines()) == 1


def test_no_two_units_of_a_chart_look_the_same():
    """Past ten units the colours used to repeat (matplotlib's C0-C9): up to 80 units, every unit's
    (colour, line style) differs, and the first ten keep the usual colours."""
    import matplotlib.colors

    from compose.report import line_style

    styles = [(matplotlib.colors.to_hex(line_style(i)["color"]), line_style(i)["linestyle"]) for i in range(80)]
    assert len(set(styles)) == 80
    assert [c for c, _ in styles[:10]] == [matplotlib.colors.to_hex(f"C{i}") for i in range(10)]
