"""Plain helpers shared by test modules (fixtures live in conftest.py).

Test modules import these from here rather than from each other or from conftest.py: importing a
test module runs its module-level setup and ties one file's helpers to another file's tests, and
pytest owns conftest.py's import. Heavy imports (jax, torch, transformers) stay inside the helpers
so that a SQL test importing this module does not pay for them.
"""
import fcntl
import itertools
import os
import pathlib
import random
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def spider_dir() -> pathlib.Path:
    """Spider data lives outside the repo (../shared/data/spider, or $CAPER_SPIDER_DIR)."""
    return pathlib.Path(os.environ.get("CAPER_SPIDER_DIR", REPO.parent / "shared" / "data" / "spider"))


def require(path: pathlib.Path) -> pathlib.Path:
    """Returns path if it exists; fails under CI (CI=true), skips elsewhere."""
    if path.exists():
        return path
    message = f"missing test data: {path} (set CAPER_SPIDER_DIR)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def xla_flags(device_count: int) -> str:
    """XLA_FLAGS for a child process with ``device_count`` simulated CPU devices, keeping the suite's own
    flags (tests/conftest.py)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={device_count}".strip()


def simulated_devices_env(device_count: int, **extra: str) -> dict[str, str]:
    """The environment of a child process (``python -m tests...`` or ``-c``) that runs JAX on ``device_count``
    simulated CPU devices and imports this repo: the device count must be set before JAX starts, so a test
    whose own process already runs JAX starts a child."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(device_count), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_train(*args: str, tmp_path=None, fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m caper_jax.train ARGS --workdir=<tmp_path>/w`` (without tmp_path: ARGS alone) from the
    repo root, output captured.

    The process is forked from a server that has imported caper_jax.train and its trainers once (see
    TrainForkServer); ``fresh=True`` starts a new interpreter instead, as the command line does
    (tests/test_train_cli.py checks that both answer alike)."""
    args = (*map(str, args), *([f"--workdir={tmp_path / 'w'}"] if tmp_path is not None else []))
    if fresh:
        return subprocess.run([sys.executable, "-m", "caper_jax.train", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
    return TrainForkServer.shared().run(args, timeout=120)


# Runs in the server process. It imports what `python -m caper_jax.train` imports (and the trainer
# modules its main imports), checks that no JAX backend (and so no XLA thread pool) exists yet, then
# forks once per request: the child runs train.main under absl.app.run exactly as train.py's __main__
# block does, with stdout and stderr on files, and exits with the status the interpreter would give.
_TRAIN_SERVER = r"""
import json, os, signal, sys, time, traceback
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)                               # nothing but replies on the reply channel
from absl import app
from caper_jax import train
import caper_jax.prm.trainer, caper_jax.rl.trainer, caper_jax.sft.trainer
import caper_jax.experiments.miniature, caper_jax.experiments.spider_verifier
from jax._src import xla_bridge
assert not xla_bridge._backends, "a JAX backend exists before the fork"
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.argv = [train.__file__, *request["args"]]   # as `-m` sets it: config_flags reads sys.argv
        code = 0
        try:
            app.run(train.main, flags_parser=train.parse_flags)
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            traceback.print_exc()
            code = 1
        if code is not None and not isinstance(code, int):   # sys.exit("message"): printed, status 1
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    deadline = time.monotonic() + request["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    reply.flush()
"""


class TrainForkServer:
    """One process per test worker that pays for caper_jax.train's imports (jax, flax, orbax, grain:
    ~3 s of CPU, nearly all of a refused config's run) once, then forks a child per command line."""

    _shared = None

    @classmethod
    def shared(cls) -> "TrainForkServer":
        if cls._shared is None or cls._shared.proc.poll() is not None:
            cls._shared = cls()
        return cls._shared

    def __init__(self):
        import tempfile

        self.log = tempfile.TemporaryFile()   # the server's own stderr: why it died, if it does
        self.proc = subprocess.Popen([sys.executable, "-c", _TRAIN_SERVER], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)

    def run(self, args, timeout: float) -> subprocess.CompletedProcess:
        import json
        import tempfile

        with tempfile.TemporaryDirectory() as outputs:
            out, err = pathlib.Path(outputs, "stdout"), pathlib.Path(outputs, "stderr")
            self.proc.stdin.write(json.dumps({"args": list(args), "stdout": str(out), "stderr": str(err),
                                              "timeout": timeout}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                self.log.seek(0)
                raise AssertionError("the train fork server died:\n"
                                     + self.log.read().decode(errors="replace")[-3000:])
            returncode = json.loads(line)["returncode"]
            if returncode == -9:
                raise subprocess.TimeoutExpired(["caper_jax.train", *args], timeout)
            return subprocess.CompletedProcess(["caper_jax.train", *args], returncode, out.read_text(),
                                               err.read_text())


def naive_spider_equal(gold, pred, ordered):
    """Brute force over all column permutations (the official rule without pruning)."""
    if not gold and not pred:
        return True
    if len(gold) != len(pred) or len(gold[0]) != len(pred[0]):
        return False
    for perm in itertools.permutations(range(len(gold[0]))):
        permuted = [tuple(row[j] for j in perm) for row in pred]
        if ordered and list(gold) == permuted:
            return True
        if not ordered and sorted(map(repr, gold)) == sorted(map(repr, permuted)):
            return True
    return False


# -- Clause-PRM pipeline inputs (tests/data/test_prm_pipeline.py, test_checkpoint.py, prm/test_step.py)

SQLS = (
    "SELECT name FROM singer WHERE age > 30 ORDER BY age DESC LIMIT 3",
    "SELECT count(*) FROM concert WHERE year = 2014",
    "SELECT T1.name , T2.title FROM singer AS T1 JOIN song AS T2 ON T1.id = T2.singer_id WHERE T2.sales > 100",
    "SELECT country , avg(age) FROM singer GROUP BY country HAVING count(*) > 1",
    "SELECT name FROM stadium UNION SELECT name FROM singer ORDER BY name",
    "SELECT DISTINCT country FROM singer WHERE is_male = 'F'",
    "SELECT max(capacity) , average FROM stadium",
)
SCHEMAS = (
    "singer(id, name, country, age, is_male) | song(id, title, singer_id, sales)",
    "stadium(id, name, capacity, average) | concert(id, stadium_id, year) | singer(id, name, age)",
)
MUTATIONS = (("age", "id"), (">", "<"), ("DESC", "ASC"), ("3", "5"), ("name", "country"), ("count", "max"),
             ("2014", "2015"), ("T1", "T2"), ("avg", "sum"), ("DISTINCT ", ""), ("UNION", "EXCEPT"), ("100", "10"))


def prompt_fn(question: str, schema: str) -> str:
    return f"Schema: {schema}\nQuestion: {question}\nSQL: "


def make_tokenizer():
    """A 600-token byte-level BPE (a PreTrainedTokenizerFast) trained on the test texts: lossless
    decode, realistic merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from caper_jax.sql.contract import END_OF_SQL

    corpus = list(SQLS) + list(SCHEMAS) + [prompt_fn(f"How many singers are older than {n}?", s)
                                           for n in range(5) for s in SCHEMAS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<pad>", END_OF_SQL], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def mutate(text: str) -> str:
    for old, new in MUTATIONS:
        if old in text:
            return text.replace(old, new, 1)
    return text + " + 1"


def make_tuples(count: int, seed: int = 0) -> list[dict]:
    """Tuples cut from real queries at split_clauses boundaries; questions of varied length."""
    from caper_jax.sql.clauses import split_clauses

    rng = random.Random(seed)
    out = []
    while len(out) < count:
        sql = rng.choice(SQLS)
        unit = rng.choice(split_clauses(sql))
        words = " very" * rng.randrange(0, 40)
        out.append(dict(
            question=f"Which{words} old singers are there #{len(out)}?", db_id="concert_singer",
            schema=rng.choice(SCHEMAS), clause=unit.name, prefix_chosen=sql[: unit.start],
            chosen=unit.text, prefix_rejected=sql[: unit.start], rejected=mutate(unit.text),
            margin=round(rng.uniform(0.1, 1.0), 3), provenance="mutation:test", gold_sql=sql,
            negative_sql=sql[: unit.start] + mutate(unit.text)))
    return out


def make_within_tuples() -> list[dict]:
    """Within-trajectory tuples as the annotator writes them: every clause of a query against one root
    clause of it (both states cut from ``negative_sql``), plus two ordinary mutation tuples."""
    from caper_jax.sql.clauses import split_clauses
    from caper_jax.sql.contract import END_OF_SQL

    out = []
    for q, sql in enumerate(SQLS):
        units = split_clauses(sql)
        root = units[q % len(units)]

        def text(u):  # the last clause ends with the end of the query, as the annotator writes it
            return u.text + (END_OF_SQL if u is units[-1] else "")
        for k, unit in enumerate(units):
            if unit is root:
                continue
            out.append(dict(
                question=f"Which singers, case {q}?", db_id="concert_singer", schema=SCHEMAS[q % 2],
                clause=root.name, prefix_chosen=sql[: unit.start], chosen=text(unit),
                prefix_rejected=sql[: root.start], rejected=text(root), margin=0.25 + 0.1 * k,
                provenance="within:test", gold_sql=sql, negative_sql=sql))
    return out + make_tuples(2, seed=5)


# -- Tiny transformers Qwen3.5 references (tests/models/test_qwen35_parity.py, test_hf_io.py, prm/test_export.py)

TINY_HF_CONFIGS = {
    # 2 groups of (3 DeltaNet + 1 attention); value heads > key heads; GQA; untied head.
    "untied": dict(
        vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
    ),
    # Period 2 (DeltaNet, attention) x 2; equal qk/v heads of different dims; MQA; tied head;
    # θ and the rotary fraction read from the checkpoint.
    "tied": dict(
        vocab_size=120, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=24, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=24, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    ),
}


def build_hf_model(name: str, seed: int = 0):
    """transformers' Qwen3_5ForCausalLM for TINY_HF_CONFIGS[name], fixed torch seed, with the weights
    transformers initialises to constants randomised so that a mis-wired norm or gate cannot hide."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(initializer_range=0.04, **TINY_HF_CONFIGS[name])
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight") and "linear_attn" not in param_name:
                param.normal_(0.0, 0.3)                 # zero-centred RMSNorm weights
            elif param_name.endswith("linear_attn.norm.weight"):
                param.normal_(1.0, 0.3)                 # plain gated norm weight
            elif param_name.endswith("A_log"):
                param.uniform_(-1.0, 1.5)
            elif param_name.endswith("dt_bias"):
                param.normal_(0.0, 1.0)
    return model


# -- Trainer workdirs built from random tiny models (tests/test_verify.py, test_eval_policy.py,
#    prm/test_sft_init.py)

def session_root(tmp_path_factory) -> pathlib.Path:
    """A directory shared by the whole pytest session, xdist workers included."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_prm_run(root: pathlib.Path) -> pathlib.Path:
    """A PRM trainer workdir (random tiny Clause-PRM): demo world + tokenizer, checkpoint, HF export.

    Built once per pytest session under a file lock (test_verify, test_eval_policy and
    prm/test_sft_init share it).
    """
    workdir = root / "prm_run"
    with open(root / "prm_run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (workdir / "READY").exists():
            _write_prm_run(workdir)
            (workdir / "READY").touch()
    return workdir


def _write_prm_run(workdir: pathlib.Path) -> None:
    from flax import nnx

    from caper_jax import checkpoint as ckpt_lib
    from caper_jax import runs
    from caper_jax.demo.world import build_demo_world
    from caper_jax.data.tokenizer import build_demo_tokenizer
    from caper_jax.models.presets import model_preset
    from caper_jax.prm.export import export_prm_to_hf
    from caper_jax.prm.model import ClausePRM
    from caper_jax.utils.optim import init_state, make_optimizer
    from configs.prm import get_config

    world = build_demo_world(workdir / "demo_world", seed=0, train_size=150, dev_size=80)
    tokenizer = build_demo_tokenizer(world / "tokenizer")
    config = get_config()
    config.data.dir = str(world)
    model = ClausePRM(model_preset("tiny", vocab_size=len(tokenizer)), rngs=nnx.Rngs(0))
    state = init_state(nnx.state(model), make_optimizer(config.optim))
    with ckpt_lib.Checkpointer(workdir / "checkpoints") as checkpointer:
        checkpointer.save(7, state, config=config.to_dict(), run=runs.record(model.config, world / "tokenizer"),
                          force=True)
    export_prm_to_hf(model, workdir / "hf_export", tokenizer)


def build_policy_run(root: pathlib.Path, world: pathlib.Path) -> pathlib.Path:
    """An SFT trainer workdir holding a random tiny policy (the trainer's checkpoint layout)."""
    from flax import nnx
    from transformers import AutoTokenizer

    from caper_jax import checkpoint as ckpt_lib
    from caper_jax import runs
    from caper_jax.models import Qwen35ForCausalLM
    from caper_jax.models.presets import model_preset
    from caper_jax.utils.optim import init_state, make_optimizer
    from configs.sft import get_config

    workdir = root / "sft_run"
    config = get_config()
    config.data.dir = str(world)
    tokenizer = AutoTokenizer.from_pretrained(str(world / "tokenizer"))
    model = Qwen35ForCausalLM(model_preset("tiny", vocab_size=len(tokenizer)), rngs=nnx.Rngs(1))
    state = init_state(nnx.state(model), make_optimizer(config.optim))
    with ckpt_lib.Checkpointer(workdir / "checkpoints") as checkpointer:
        checkpointer.save(3, state, config=config.to_dict(), run=runs.record(model.config, world / "tokenizer"),
                          force=True)
    return workdir


def run_command(module, *args) -> int:
    """``python -m <module> args`` in this process, as its ``__main__`` runs under absl.app.run: flags
    defined on a FlagValues of their own (runs in one process share none), parsed, then ``main``.
    Returns the exit status the command line would have, a bad command line's included (its one
    error line on stderr). An ``absl.app.UsageError`` is not caught: absl.app.run would print it
    after the whole module docstring, which the commands promise not to do."""
    import inspect

    from absl import flags

    from caper_jax.utils import cli

    argv = [module.__name__, *map(str, args)]
    flag_values = flags.FlagValues()
    if "argv" in inspect.signature(module.define_flags).parameters:   # config_flags' overrides come from argv
        module.define_flags(flag_values, argv)
    else:
        module.define_flags(flag_values)
    parse = getattr(module, "parse_flags", cli.parse_flags)
    try:
        return module.main(parse(argv, flag_values), flag_values)
    except SystemExit as exit:
        return exit.code
