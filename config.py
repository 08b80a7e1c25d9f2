"""
train.py's configuration, nanoGPT-style (its configurator.py): the defaults at the top of train.py, then each config
file (a Python file of `key = value` lines) and --key=value argument in order. Each value keeps its default's type;
an unknown key, a wrong type or a file that is not such a Python file is one sentence. train.load_config then checks
the values.
"""

import ast
import builtins
import traceback
from pathlib import Path


def parse(argv, defaults):
    """defaults updated by argv (config files and --key=value, in order), each value of its default's type."""
    cfg = dict(defaults)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq:
                raise SystemExit(f"config: expected --key=value, got {arg!r}")
            if key not in cfg:
                raise SystemExit(f"config: unknown key {key!r} (from {arg!r})")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare string
            cfg[key] = _typed(key, value, defaults[key])
        else:
            ns = run_config_file(arg)
            for key, value in ns.items():
                if key.startswith("_") or callable(value) or type(value).__name__ == "module":
                    continue
                if key not in cfg:
                    raise SystemExit(f"config: unknown key {key!r} in {arg}")
                cfg[key] = _typed(key, value, defaults[key])
    return cfg


def _typed(key, value, default):
    ok = isinstance(value, type(default)) or (isinstance(default, float) and isinstance(value, int)) or \
        (isinstance(default, list) and isinstance(value, (list, tuple)))
    if not ok or (isinstance(default, int) and isinstance(value, bool) != isinstance(default, bool)):
        raise SystemExit(f"config: {key} must be {type(default).__name__}, got {value!r} ({type(value).__name__})")
    return float(value) if isinstance(default, float) else (list(value) if isinstance(default, list) else value)


def run_config_file(arg):
    """The names config file `arg` assigns. It must be an existing .py file of assignments: YAML's `key: value`
    parses as a Python annotation and would be silently ignored. Whatever it raises is named with its line."""
    path = Path(arg)
    if not path.is_file():
        raise SystemExit(f"config: {arg}: no such file (arguments are a config file or --key=value)")
    if path.suffix != ".py":
        raise SystemExit(f"config: {arg}: a config is a Python file of `key = value` lines (configs/*.py), "
                         f"not {path.suffix or 'a file without a suffix'}")
    try:
        tree = ast.parse(path.read_text(), filename=arg)
    except (SyntaxError, ValueError, UnicodeDecodeError) as e:
        raise SystemExit(f"config: {arg}: not valid Python ({e})") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and node.value is None:
            raise SystemExit(f"config: {arg}:{node.lineno}: `{ast.unparse(node)}` assigns nothing (YAML? write "
                             f"key = value)")
    ns = {}
    try:
        exec(builtins.compile(tree, arg, "exec"), ns)  # noqa: S102  trusted Python, as in nanoGPT (`compile` is a key)
    except Exception as e:  # noqa: BLE001  whatever the file raises: name the file and its line
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == arg]
        raise SystemExit(f"config: {arg}:{lines[-1] if lines else '?'}: raised {type(e).__name__}: {e}") from None
    return ns
