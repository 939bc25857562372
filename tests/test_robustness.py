"""Nothing lost, nothing silently wrong: the command lines as a hostile user drives them.

* An output that is (or resolves to) an input or a database is refused with one line, before any
  work, and the input is left byte for byte; so are missing, read-only and directory outputs.
* Ctrl-C is a real SIGINT sent to a real process while SQLite runs an endless recursive CTE: the
  run stops with exit status 130, prints no summary, and the output file keeps its previous content
  (outputs are written to a temporary file and renamed into place only at the end).
* Lines that would change the input without a word (invalid UTF-8, a lone surrogate, a repeated
  ``index``) are reported with their line number and skipped; refused settings (a negative
  ``limit``, ``--beam`` without apache-beam, ``convert verify`` without torch, a bad workdir, a
  ``--db`` that is not a database, a checkpoint of the wrong shape) are one line, before any work.

References: the input files themselves (their bytes before and after), SQLite (the interrupted query
really is endless: it would only stop at its 120 s timeout), and the processes' exit statuses.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, run_command, run_train

# Never ends on its own: SQLite counts until the executor's deadline (set far beyond the test).
ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
OLD = "previous complete output\n"


@pytest.fixture(scope="module")
def db(spider, tmp_path_factory) -> pathlib.Path:
    """A private copy of concert_singer: a test that failed to refuse must not damage ../shared."""
    copy = tmp_path_factory.mktemp("db") / "concert_singer.sqlite"
    shutil.copyfile(spider / "database" / "concert_singer" / "concert_singer.sqlite", copy)
    return copy


@pytest.fixture(scope="module")
def concert_index(spider) -> int:
    examples = json.loads((spider / "dev.json").read_text())
    return next(i for i, e in enumerate(examples) if e["db_id"] == "concert_singer")


def write_lines(path: pathlib.Path, lines) -> pathlib.Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def run_module(*args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def no_temporary_files(directory: pathlib.Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.endswith(".tmp") or ".partial-" in p.name]


@contextlib.contextmanager
def read_only_dir(path: pathlib.Path):
    """A directory no file can be created in, for root too (chmod, else chattr +i); skips if impossible."""
    path.mkdir()

    def writable() -> bool:
        try:
            (path / ".probe").touch()
        except OSError:
            return False
        (path / ".probe").unlink()
        return True

    os.chmod(path, 0o555)
    immutable = False
    if writable() and shutil.which("chattr"):
        immutable = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    try:
        if writable():
            pytest.skip("cannot make a read-only directory here (root without chattr)")
        yield path
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        os.chmod(path, 0o755)


# ---------------------------------------------------------------------------------------------
# Outputs that would overwrite an input


def annotate(*args) -> subprocess.CompletedProcess:
    return run_module("caper_jax.annotate", *args)


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link", "dot-dot path"])
def test_annotate_refuses_an_output_that_is_its_input(tmp_path, db, how):
    inp = write_lines(tmp_path / "in.jsonl", [{"gold": "SELECT 1", "pred": "SELECT 1"}])
    before = inp.read_bytes()
    out = {"same path": lambda: inp,
           "symlink": lambda: (tmp_path / "link.jsonl").symlink_to(inp) or tmp_path / "link.jsonl",
           "hard link": lambda: os.link(inp, tmp_path / "hard.jsonl") or tmp_path / "hard.jsonl",
           "dot-dot path": lambda: (tmp_path / "sub").mkdir() or tmp_path / "sub" / ".." / "in.jsonl"}[how]()
    for command in ("localize", "inject"):
        proc = annotate(command, "--db", db, "--input", inp, "--output", out)
        assert_one_line_error(proc, "is the input", "would be overwritten")
        assert inp.read_bytes() == before


def test_annotate_refuses_to_overwrite_the_database(tmp_path, db):
    inp = write_lines(tmp_path / "in.jsonl", [{"gold": "SELECT 1", "pred": "SELECT 1"}])
    other_db = tmp_path / "other.sqlite"
    shutil.copyfile(db, other_db)
    before = db.read_bytes()
    assert_one_line_error(annotate("localize", "--db", db, "--input", inp, "--output", db), "is the input")
    # Any SQLite file, not only this command's database.
    assert_one_line_error(annotate("localize", "--db", db, "--input", inp, "--output", other_db),
                          "is a SQLite database")
    assert db.read_bytes() == before and other_db.read_bytes() == before


def test_annotate_refuses_bad_files_before_any_work(tmp_path, db):
    inp = write_lines(tmp_path / "in.jsonl", [{"gold": "SELECT 1", "pred": "SELECT 1"}])
    text_db = tmp_path / "db.sqlite"
    text_db.write_text("this is not a database\n")
    (tmp_path / "empty.sqlite").touch()
    cases = [
        (("--db", text_db, "--input", inp, "--output", tmp_path / "o.jsonl"), "is not a SQLite database"),
        (("--db", tmp_path / "empty.sqlite", "--input", inp, "--output", tmp_path / "o.jsonl"), "empty file"),
        (("--db", tmp_path / "absent.sqlite", "--input", inp, "--output", tmp_path / "o.jsonl"), "no such file"),
        (("--db", db, "--input", tmp_path / "absent.jsonl", "--output", tmp_path / "o.jsonl"), "no such file"),
        (("--db", db, "--input", inp, "--output", tmp_path / "nowhere" / "o.jsonl"), "does not exist"),
        (("--db", db, "--input", inp, "--output", tmp_path), "is a directory"),
    ]
    for args, message in cases:
        assert_one_line_error(annotate("localize", *args), message)
    assert not (tmp_path / "o.jsonl").exists()


def test_read_only_output_directory_is_refused_before_any_work(tmp_path, db):
    inp = write_lines(tmp_path / "in.jsonl", [{"gold": "SELECT 1", "pred": "SELECT 1"}])
    with read_only_dir(tmp_path / "ro") as ro:
        assert_one_line_error(annotate("localize", "--db", db, "--input", inp, "--output", ro / "o.jsonl"),
                              "cannot write in directory")


def test_evaluate_ex_refuses_to_overwrite_its_predictions(spider, tmp_path, concert_index, capsys):
    from caper_jax import evaluate

    predictions = write_lines(tmp_path / "p.jsonl", [{"index": concert_index, "pred": "SELECT 1"}])
    before = predictions.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(predictions)
    for out in (predictions, link):
        code = run_command(evaluate, "ex", "--data", spider, "--predictions", predictions, "--output", out)
        err = capsys.readouterr().err
        assert code == 2 and "is the input" in err and err.count("\n") == 1, err
        assert predictions.read_bytes() == before


def test_verify_refuses_to_overwrite_its_candidates_before_loading_the_prm(spider, tmp_path, concert_index, capsys):
    from caper_jax import verify

    candidates = write_lines(tmp_path / "c.jsonl", ["not json", {"index": concert_index, "candidates": ["SELECT 1"]}])
    before = candidates.read_bytes()
    # --prm names nothing: the output is refused before the PRM would be looked for.
    code = run_command(verify, "--prm", tmp_path / "no_prm", "--data", spider, "--candidates", candidates,
                       "--output", candidates)
    err = capsys.readouterr().err
    assert code == 2 and "is the input" in err and "no PRM" not in err, err
    assert candidates.read_bytes() == before
    code = run_command(verify, "localize", "--prm", tmp_path, "--data", spider, "--predictions", candidates,
                       "--output_dir", candidates)
    err = capsys.readouterr().err
    assert code == 2 and "--output_dir" in err and candidates.read_bytes() == before, err


def test_atomic_writer_keeps_the_old_file_until_the_new_one_is_complete(tmp_path):
    from caper_jax.utils import atomic

    target = tmp_path / "out.jsonl"
    target.write_text(OLD)
    os.chmod(target, 0o640)
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic_output(target) as f:
            f.write("half")
            assert target.read_text() == OLD       # nothing visible while writing
            raise KeyboardInterrupt
    assert target.read_text() == OLD and no_temporary_files(tmp_path)
    with atomic.atomic_output(target) as f:
        f.write("new\n")
    assert target.read_text() == "new\n" and no_temporary_files(tmp_path)
    assert (target.stat().st_mode & 0o777) == 0o640   # permissions of the file it replaced
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    with atomic.atomic_output(link) as f:
        f.write("through the link\n")
    assert link.is_symlink() and target.read_text() == "through the link\n"
    # A device (or pipe) is written in place, never replaced by a rename: /dev/null stays a device.
    import stat
    assert atomic.check_output("/dev/null") == pathlib.Path("/dev/null")
    with atomic.atomic_output("/dev/null") as f:
        f.write("discarded\n")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


# ---------------------------------------------------------------------------------------------
# Ctrl-C: a real SIGINT to a real process while SQLite runs an endless query


def interrupt_during_query(args: list, marker: bytes, *, delay_s: float = 1.5) -> tuple[int, str, str]:
    """Starts ``python args``, waits for ``marker`` on its stderr, lets the endless query start, sends SIGINT.

    Returns (exit status, stdout, stderr). Fails if the process does not stop within 30 s of the
    signal (a swallowed interrupt would let it run on to its 120 s query timeout).
    """
    # SIGINT back to its default in the child: a suite started as a background job of a script
    # (nohup ... &) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
    proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = b""
    deadline = time.monotonic() + 180
    try:
        while marker not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen.decode(errors="replace")[-3000:]
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                seen += os.read(proc.stderr.fileno(), 65536)
        time.sleep(delay_s)
        assert proc.poll() is None, "the process ended before the signal"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, stdout.decode(), (seen + stderr).decode(errors="replace")


def assert_interrupted(rc: int, stdout: str, stderr: str, out: pathlib.Path) -> None:
    assert rc == 130, (rc, stderr[-3000:])
    assert "SQLite query interrupted" in stderr, stderr[-3000:]   # the signal landed inside SQLite
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not stdout.strip(), stdout                              # no summary that looks complete
    assert out.read_text() == OLD and no_temporary_files(out.parent)


def test_ctrl_c_in_a_query_stops_evaluate_ex(spider, tmp_path, concert_index):
    predictions = write_lines(tmp_path / "p.jsonl", ["not json", {"index": concert_index, "pred": ENDLESS},
                                                     {"index": concert_index + 1, "pred": "SELECT 1"}])
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    result = interrupt_during_query(["-m", "caper_jax.evaluate", "ex", "--data", spider, "--predictions",
                                     predictions, "--output", out, "--timeout_s", "120"], b"p.jsonl:1: skipped")
    assert_interrupted(*result, out)


@pytest.mark.parametrize("command, line", [("localize", {"gold": ENDLESS, "pred": "SELECT 1"}),
                                           ("inject", {"gold": ENDLESS})])
def test_ctrl_c_in_a_query_stops_annotate(tmp_path, db, command, line):
    inp = write_lines(tmp_path / "in.jsonl", ["not json", line, {"gold": "SELECT name FROM singer", "pred": "SELECT 1"}])
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    result = interrupt_during_query(["-m", "caper_jax.annotate", command, "--db", db, "--input", inp, "--output", out,
                                     "--config=configs/annotate.py", "--config.timeout_s=120",
                                     # the instruction budget would end the endless query before the signal
                                     "--config.max_vm_steps=1000000000000"], b"in.jsonl:1: skipped")
    assert_interrupted(*result, out)


def test_ctrl_c_in_a_query_stops_annotate_build(tmp_path, db):
    manual = tmp_path / "manual"
    (manual / "database" / "concert_singer").mkdir(parents=True)
    os.symlink(db, manual / "database" / "concert_singer" / "concert_singer.sqlite")
    (manual / "dev.json").write_text(json.dumps([{"db_id": "concert_singer", "question": "q", "query": ENDLESS}]))
    data_dir = tmp_path / "tfds"
    rc, stdout, stderr = interrupt_during_query(
        ["-m", "caper_jax.annotate", "build", "--config=configs/annotate.py", f"--config.data.manual_dir={manual}",
         f"--config.data_dir={data_dir}", "--config.timeout_s=120",
         "--config.max_vm_steps=1000000000000"], b"annotate dev", delay_s=3.0)
    assert rc == 130 and "SQLite query interrupted" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "dataset:" not in stdout      # no summary
    finished = [p for p in data_dir.rglob("dataset_info.json") if "incomplete" not in str(p)]
    assert not finished, finished


def test_ctrl_c_in_a_query_stops_verify(spider, tmp_path, concert_index):
    candidates = write_lines(tmp_path / "c.jsonl", ["not json", {"index": concert_index, "candidates": [ENDLESS]}])
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    # The PRM is scored after every line is executed; a stand-in scorer keeps the test to the SQLite part.
    code = ("import caper_jax.prm.scoring as s; s.load_scorer = lambda *a, **k: None; "
            "from absl import app; from caper_jax import verify; from caper_jax.utils import cli; "
            "verify.define_flags(); app.run(verify.main, flags_parser=cli.parse_flags)")
    result = interrupt_during_query(["-c", code, "--prm", tmp_path, "--data", spider, "--candidates", candidates,
                                     "--output", out, "--timeout_s", "120"], b"c.jsonl:1: skipped")
    assert_interrupted(*result, out)


# ---------------------------------------------------------------------------------------------
# Inputs that would be changed without a word


def test_annotate_reports_bad_bytes_and_lone_surrogates_by_line(tmp_path, db):
    good = json.dumps({"gold": "SELECT name FROM singer", "pred": "SELECT name FROM singer"}).encode()
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\n".join([
        good,
        b'{"gold": "SELECT name FROM singer", "pred": "SELECT \xff FROM singer"}',      # not UTF-8
        b'{"gold": "SELECT name FROM singer", "pred": "SELECT \\ud800 FROM singer"}',  # lone surrogate
        b'{"gold": "SELECT name FROM singer", "pred": "SELECT \\ud83d\\ude00 FROM singer"}',  # a valid pair
        good]) + b"\n")
    out = tmp_path / "out.jsonl"
    proc = annotate("localize", "--db", db, "--input", inp, "--output", out)
    assert proc.returncode == 0, proc.stderr
    assert "in.jsonl:2: skipped: not UTF-8" in proc.stderr
    assert "in.jsonl:3: skipped: holds a lone surrogate (\\ud800" in proc.stderr
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 3 and rows[1]["pred"] == "SELECT \U0001F600 FROM singer"
    assert "\ufffd" not in out.read_text(encoding="utf-8")


def test_evaluate_ex_reports_bad_lines_and_repeated_indices_by_line(spider, tmp_path, concert_index):
    from caper_jax.eval.ex import evaluate_ex

    examples = json.loads((spider / "dev.json").read_text())
    gold = examples[concert_index]["query"]
    predictions = tmp_path / "p.jsonl"
    predictions.write_bytes(b"\n".join([
        json.dumps({"index": concert_index, "pred": gold}).encode(),
        b'{"index": %d, "pred": "SELECT \xff"}' % (concert_index + 1),
        b'{"index": %d, "pred": "SELECT \\udc00"}' % (concert_index + 2),
        json.dumps({"index": concert_index, "pred": "SELECT 'wrong'"}).encode(),   # repeated index
        json.dumps({"index": concert_index + 3, "pred": examples[concert_index + 3]["query"]}).encode()]) + b"\n")
    reports, out = [], tmp_path / "out.jsonl"
    summary = evaluate_ex(spider, "dev", predictions, output=out, report=reports.append)
    assert summary["n"] == 2 and summary["ex"] == 1.0 and summary["malformed"] == 3, (summary, reports)
    assert [r.split(":")[1] for r in reports] == ["2", "3", "4"]
    assert "not UTF-8" in reports[0] and "lone surrogate" in reports[1]
    assert f"index {concert_index} again (first at line 1)" in reports[2]
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [concert_index, concert_index + 3]


def test_verify_localize_skips_lone_surrogates_and_bad_bytes_by_line(spider, tmp_path, concert_index):
    from caper_jax.eval import verifier

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"index": %d, "pred": "SELECT \\ud800", "root_clause": "SELECT"}\n' % concert_index
                     + b'{"index": %d, "pred": "SELECT \xfe", "root_clause": "SELECT"}\n' % concert_index
                     + b'{"index": %d, "pred": "SELECT name FROM singer", "root_clause": "SELECT"}\n' % concert_index)
    reports = []
    rows, skipped = verifier.read_failures(spider, "dev", path, report=reports.append)
    assert len(rows) == 1 and skipped == {"malformed": 2}
    assert reports[0].startswith(f"{path}:1: skipped: holds a lone surrogate") and f"{path}:2: skipped: not UTF-8" in reports[1]


def test_negative_limit_and_beam_without_apache_beam_are_refused_before_any_work(tmp_path, spider):
    start = time.monotonic()
    proc = annotate("build", "--config=configs/annotate.py:limit=-5", f"--config.data.manual_dir={spider}",
                    f"--config.data_dir={tmp_path / 'tfds'}")
    assert_one_line_error(proc, "data.limit=-5", ">= 0")
    assert not (tmp_path / "tfds").exists() and time.monotonic() - start < 60
    code = ("import sys; sys.modules['apache_beam'] = None; from absl import app; from caper_jax import annotate; "
            "annotate.define_flags(); app.run(annotate.main)")
    proc = subprocess.run([sys.executable, "-c", code, "build", "--config=configs/annotate.py", "--beam",
                           f"--config.data.manual_dir={spider}", f"--config.data_dir={tmp_path / 'tfds'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert_one_line_error(proc, "--beam needs apache-beam")
    assert not (tmp_path / "tfds").exists()


# ---------------------------------------------------------------------------------------------
# convert and train: one line, before any work


def test_convert_verify_without_torch_says_so_and_fails(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    code = ("import sys; sys.modules['torch'] = None; from absl import app; from caper_jax import convert; "
            "from caper_jax.utils import cli; convert.define_flags(); app.run(convert.main, flags_parser=cli.parse_flags)")
    proc = subprocess.run([sys.executable, "-c", code, "verify", "--hf_dir", str(hf)], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert_one_line_error(proc, "needs torch", "requirements-test.txt")
    assert not proc.stdout.strip()   # no report with null metrics


def test_convert_refuses_bad_inputs_and_outputs_with_one_line(tmp_path, capsys):
    import numpy as np
    from flax import nnx
    from safetensors.numpy import load_file, save_file

    from caper_jax import convert
    from caper_jax.models import Qwen35ForCausalLM, to_hf
    from caper_jax.models.presets import model_preset

    config = model_preset("tiny", vocab_size=64)
    good = tmp_path / "good"
    to_hf(Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)), config, good)
    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(good, wrong_shape)
    (single,) = wrong_shape.glob("*.safetensors")
    tensors = load_file(single)
    tensors["model.norm.weight"] = np.zeros(3, tensors["model.norm.weight"].dtype)
    save_file(tensors, single)
    no_config = tmp_path / "no_config"
    shutil.copytree(good, no_config)
    (no_config / "config.json").unlink()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")

    cases = [
        (["hf-to-orbax", "--hf_dir", no_config, "--out", tmp_path / "o1"], "has no config.json"),
        (["hf-to-orbax", "--hf_dir", tmp_path / "absent", "--out", tmp_path / "o1"], "no such directory"),
        (["orbax-to-hf", "--ckpt", tmp_path / "absent", "--out", tmp_path / "o1"], "does not exist"),
        (["hf-to-orbax", "--hf_dir", good, "--out", good], "is (or holds) the input"),
        (["hf-to-orbax", "--hf_dir", good, "--out", tmp_path / "busy"], "not empty"),
        (["hf-to-orbax", "--hf_dir", wrong_shape, "--out", tmp_path / "o1"], "shape"),
        (["orbax-to-hf", "--ckpt", good, "--out", tmp_path / "o1"], "neither a trainer workdir"),
    ]
    before = sorted(p.name for p in good.iterdir())
    for args, message in cases:
        code = run_command(convert, *args)
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, (args, err)
    assert not (tmp_path / "o1").exists() and no_temporary_files(tmp_path), sorted(tmp_path.iterdir())
    assert sorted(p.name for p in good.iterdir()) == before and (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        assert run_command(convert, "hf-to-orbax", "--hf_dir", good, "--out", tmp_path / "o2") == 0
    assert (tmp_path / "o2" / "checkpoints" / "0").is_dir() and no_temporary_files(tmp_path)



@pytest.mark.parametrize("args, message", [
    (["caper_jax.verify", "--output_dir", "x"], "verify rerank: not a flag of this command: --output_dir"),
    (["caper_jax.verify", "rank"], "usage: python -m caper_jax.verify"),
    (["caper_jax.evaluate", "ex", "--data", "x"], "evaluate ex: --predictions required"),
    (["caper_jax.evaluate"], "usage: python -m caper_jax.evaluate"),
    (["caper_jax.convert", "hf-to-orbax"], "convert hf-to-orbax: --hf_dir, --out required"),
    (["caper_jax.convert"], "usage: python -m caper_jax.convert"),
    (["caper_jax.annotate", "frobnicate"], "usage: python -m caper_jax.annotate"),
    (["caper_jax.annotate", "localize", "--db", "x.sqlite"], "localize needs --input"),
    (["caper_jax.eval.world_seeds"], "usage: python -m caper_jax.eval.world_seeds"),
], ids=["verify wrong command's flag", "verify unknown command", "evaluate missing flag",
        "evaluate no command", "convert missing flags", "convert no command", "annotate unknown command",
        "annotate missing flag", "world_seeds no workdir"])
def test_command_line_errors_after_parsing_are_one_line_under_absl_app_run(args, message):
    """The real ``python -m`` (absl.app.run), not run_command: a UsageError there would print the
    module docstring and every flag before its message."""
    proc = run_module(*args, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr[-3000:]
    assert not proc.stdout


def train(workdir, *extra) -> subprocess.CompletedProcess:
    return run_train("--config=configs/prm.py", f"--workdir={workdir}", *extra)


def test_train_refuses_a_workdir_that_is_a_file_or_read_only(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    proc = train(tmp_path / "file")
    assert proc.returncode != 0 and "--workdir" in proc.stderr and "is a file" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and (tmp_path / "file").read_text() == "not a directory"
    proc = train(tmp_path / "file" / "below")
    assert proc.returncode != 0 and "not a directory" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    with read_only_dir(tmp_path / "ro") as ro:
        for workdir in (ro, ro / "run"):
            proc = train(workdir)
            assert proc.returncode != 0 and "cannot write in directory" in proc.stderr, proc.stderr[-2000:]
            assert "Traceback" not in proc.stderr


def test_train_refuses_a_url_as_workdir():
    """pathlib reads gs://bucket/run as the relative folder gs:/bucket/run: the run would land on the local
    disk (here the repo, where run_train runs), not in the bucket."""
    proc = train("gs://bucket/run")
    assert proc.returncode != 0 and "URLs are not supported" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (REPO / "gs:").exists()


# ---------------------------------------------------------------------------------------------
# Inputs that were graded silently wrong, or ended in a traceback


def test_evaluate_ex_refuses_a_published_file_with_another_count_of_predictions(spider, tmp_path, capsys):
    """Line i of a .sql/.txt/.csv file is example i: a truncated file was graded on its first lines
    (500 lines of graphix_t5.sql gave "EX 85.4 %, n 438", no word of the 534 examples missing)."""
    from caper_jax import evaluate

    examples = json.loads((spider / "dev.json").read_text())
    short = tmp_path / "short.sql"
    short.write_text("".join(e["query"] + "\n" for e in examples[:500]))
    code = run_command(evaluate, "ex", "--data", spider, "--predictions", short)
    captured = capsys.readouterr()
    assert code == 2 and not captured.out, captured
    assert f"{short}: 500 predictions for {len(examples)} examples" in captured.err and "Traceback" not in captured.err
    full = tmp_path / "full.sql"
    full.write_text("".join(e["query"] + "\n" for e in examples))
    with contextlib.redirect_stderr(open(os.devnull, "w")):
        assert run_command(evaluate, "ex", "--data", spider, "--predictions", full) == 0


def test_a_directory_given_as_predictions_is_one_line(spider, tmp_path, capsys):
    """IsADirectoryError is an OSError, not the FileNotFoundError the command lines report."""
    from caper_jax import evaluate
    from caper_jax.utils import jsonl

    code = run_command(evaluate, "ex", "--data", spider, "--predictions", tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and f"{tmp_path} is a directory, not a JSON-lines file" in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="is a directory"):   # verify rerank / localize read through it too
        with jsonl.open_text_lines(tmp_path):
            pass


def test_a_split_file_that_is_not_utf8_is_named(tmp_path):
    """The error was "'utf-8' codec can't decode byte 0xe9 in position 45": no file named."""
    from caper_jax.data.spider import DataError, load_split

    (tmp_path / "dev.json").write_bytes(b'[{"db_id": "a", "question": "caf\xe9", "query": "SELECT 1"}]')
    with pytest.raises(DataError, match=r"dev\.json is not UTF-8 \(byte 33 is b.\\xe9."):
        load_split(tmp_path, "dev")


@pytest.mark.parametrize("args, message", [
    (["--config=configs/annotate.py", "--config.alphaa=2"], "invalid annotate config"),
    (["--config=configs/annotate.py", "--config.alpha=abc"], "could not convert string to float"),
    (["--config=configs/annotate.py:limt=3"], "unknown config arg 'limt'"),
    (["--config=configs/annotatee.py"], "--config: cannot load the config file"),
    (["--ouput", "o.jsonl"], "Unknown command line flag 'ouput'"),
], ids=["config key typo", "config value type", "config arg typo", "config file missing", "flag typo"])
def test_annotate_config_and_flag_mistakes_are_one_line(tmp_path, db, args, message):
    """annotate ran absl.app.run without the one-line flag parser: a config typo was a traceback and a
    flag typo two "FATAL Flags parsing error" lines with exit status 1."""
    inp = write_lines(tmp_path / "in.jsonl", [{"gold": "SELECT 1", "pred": "SELECT 1"}])
    out = [] if "--ouput" in args else ["--output", tmp_path / "o.jsonl"]
    proc = annotate("localize", "--db", db, "--input", inp, *out, *args)
    assert_one_line_error(proc, message)
    assert not (tmp_path / "o.jsonl").exists()


def test_annotate_inject_refuses_a_negative_per_query_before_any_work(tmp_path, db):
    inp = write_lines(tmp_path / "in.jsonl", [{"gold": "SELECT Name FROM singer"}])
    proc = annotate("inject", "--db", db, "--input", inp, "--output", tmp_path / "o.jsonl", "--per_query", "-3")
    assert_one_line_error(proc, "per_query must be >= 0, got -3")
    assert not (tmp_path / "o.jsonl").exists()


# The trainers' errors at the command line, with a stand-in trainer (no data, model or compilation).
_FAKE_TRAINER = r"""
import sys, types
from absl import app
from caper_jax import train
from caper_jax.data.spider import DataError
from caper_jax.utils.errors import CheckpointError, NonFiniteLossError

def run(config, workdir):
    raise {"data": DataError("/x/dev.json example 2 lacks string field(s) ['question']"),
           "checkpoint": CheckpointError("checkpoint /w/checkpoints/6 does not fit this run's state"),
           "nonfinite": NonFiniteLossError("step 4: 3 consecutive non-finite losses/gradients"),
           "interrupt": KeyboardInterrupt()}[config.raises]

sys.modules["fake_trainer"] = types.SimpleNamespace(validate=lambda config: config, run=run, dry_run=None)
train.TRAINERS["fake"] = "fake_trainer"
app.run(train.main, flags_parser=train.parse_flags)
"""


@pytest.mark.parametrize("raises, status, message", [
    ("data", 2, "error: /x/dev.json example 2 lacks string field(s)"),
    ("checkpoint", 2, "error: checkpoint /w/checkpoints/6 does not fit"),
    ("nonfinite", 1, "error: step 4: 3 consecutive non-finite losses"),
    ("interrupt", 130, "interrupted: training stopped; the newest whole checkpoint in"),
])
def test_train_reports_what_a_run_finds_wrong_in_one_line(tmp_path, raises, status, message):
    """A malformed split file, a checkpoint that does not fit (or a missing SFT run), a run of
    non-finite losses and Ctrl-C all ended `python -m caper_jax.train` with a traceback (Ctrl-C:
    two, one of them from orbax's commit thread, and exit status -2)."""
    config = tmp_path / "fake.py"
    config.write_text("from ml_collections import ConfigDict\n"
                      f"def get_config():\n    return ConfigDict({{'trainer': 'fake', 'raises': {raises!r}}})\n")
    proc = subprocess.run([sys.executable, "-c", _FAKE_TRAINER, f"--config={config}", f"--workdir={tmp_path / 'w'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr[-3000:]


def test_convert_refuses_a_truncated_safetensors_file_with_one_line(tmp_path, capsys):
    """A partial download (header cut, or data cut after an intact header) was a SafetensorError traceback."""
    from flax import nnx

    from caper_jax import convert
    from caper_jax.models import Qwen35ForCausalLM, to_hf
    from caper_jax.models.presets import model_preset

    config = model_preset("tiny", vocab_size=64)
    good = tmp_path / "good"
    to_hf(Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)), config, good)
    size = (good / "model.safetensors").stat().st_size
    for name, keep in (("header_cut", 5000), ("data_cut", size - 100_000)):
        damaged = tmp_path / name
        shutil.copytree(good, damaged)
        os.truncate(damaged / "model.safetensors", keep)
        code = run_command(convert, "hf-to-orbax", "--hf_dir", damaged, "--out", tmp_path / f"out_{name}")
        err = capsys.readouterr().err
        assert code == 2 and "is not a readable safetensors file" in err and err.count("\n") == 1, (name, err)
        assert not (tmp_path / f"out_{name}").exists()
