"""GRPO's reward functions: `grpo.reward_funcs` specs -> callables with TRL's signature, and their weighted score.

A spec is one of:
- a built-in (BUILTINS): `exact_match[:COLUMN]` (1.0 when the completion, stripped, equals the row's COLUMN,
  default `answer`, stripped), `numeric_match[:COLUMN]` (1.0 when the completion's last number equals the last
  number of COLUMN, default `answer`: GSM8K's "... #### 42" reads as 42), `format:REGEX` (1.0 when the stripped
  completion matches REGEX whole, `.` matching newlines), `think_format` (TRL's think_format_reward:
  `<think>...</think>` then the answer), `length_penalty:N` (0 up to N completion tokens, then -(tokens - N) / N,
  down to -1);
- `path/to/file.py:function`: a relative path is looked up in the current directory, then the recipe's folder
  (as config/load.py resolves data files);
- `package.module:function`, imported.

Every function is called as TRL's GRPOTrainer calls it (trl 1.16, `_calculate_rewards`):
`fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=..., log_metric=..., **columns)`
-> one float (or None: not applicable) per completion. Completions are strings, or for conversational prompts
`[{"role": "assistant", "content": text}]`, as TRL hands them; `trainer_state` has TRL's `global_step`;
`log_extra` and `log_metric` are accepted and ignored. So a TRL reward function (which takes **kwargs) runs
unchanged. The total is TRL's: the weighted nansum over functions, NaN where every function returned None.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from shardtune.errors import UserError

if TYPE_CHECKING:
    from shardtune.config.schema import Recipe

KEY = "grpo.reward_funcs"
# What TRL passes besides the data columns: a function's parameters with these names are not columns.
TRL_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
DEFAULT_COLUMN = "answer"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class RewardFunc:
    name: str  # the spec as written: what metrics and error lines call it
    fn: Callable[..., list[Any]]
    columns: tuple[str, ...]  # data columns it needs (a function's parameters without defaults)


def completion_text(completion: Any) -> str:
    """A completion as text: a string, or TRL's conversational [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


def as_completions(prompts: Sequence[Any], texts: Sequence[str]) -> list[Any]:
    """Decoded completions as TRL hands them to reward functions: the text, or for a conversational prompt (a
    message list) [{"role": "assistant", "content": text}]."""
    return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]


def last_number(text: Any) -> float | None:
    found = _NUMBER.findall(str(text))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:  # "1,,2" style leftovers
        return None


def _exact_match(column: str) -> Callable[..., list[float]]:
    def exact_match(completions: list[Any], **columns: Any) -> list[float]:
        return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, columns[column])]
    return exact_match


def _numeric_match(column: str) -> Callable[..., list[float]]:
    def numeric_match(completions: list[Any], **columns: Any) -> list[float]:
        out = []
        for c, a in zip(completions, columns[column]):
            got, want = last_number(completion_text(c)), last_number(a)
            out.append(float(got is not None and want is not None and math.isclose(got, want, rel_tol=0, abs_tol=1e-9)))
        return out
    return numeric_match


def _format(pattern: str) -> Callable[..., list[float]]:
    regex = re.compile(pattern, re.DOTALL)

    def format_match(completions: list[Any], **_: Any) -> list[float]:
        return [float(regex.fullmatch(completion_text(c).strip()) is not None) for c in completions]
    return format_match


def _length_penalty(limit: int) -> Callable[..., list[float]]:
    def length_penalty(completions: list[Any], completion_ids: list[list[int]] | None = None, **_: Any) -> list[float]:
        assert completion_ids is not None, "length_penalty counts completion tokens: score() needs completion_ids"
        return [-min(1.0, max(0, len(ids) - limit) / limit) for ids in completion_ids]
    return length_penalty


# name -> (factory of the argument after the colon, the argument's default or None when required, its meaning)
BUILTINS: dict[str, tuple[Callable[[str], Callable[..., list[float]]], str | None, str]] = {
    "exact_match": (_exact_match, DEFAULT_COLUMN, "COLUMN"),
    "numeric_match": (_numeric_match, DEFAULT_COLUMN, "COLUMN"),
    "format": (_format, None, "REGEX"),
    "think_format": (lambda _: _format(r"<think>(?!.*<think>).*?</think>.*"), "", ""),
    "length_penalty": (lambda n: _length_penalty(int(n)), None, "N"),
}


def load_reward_funcs(specs: Sequence[str], *, recipe_dir: str | Path | None = None) -> list[RewardFunc]:
    """Each spec (see the module docstring) as a RewardFunc; a bad spec is a UserError naming it."""
    for i, spec in enumerate(specs):
        if spec in specs[:i]:  # the spec names its metrics and its per-function scores
            raise UserError(f"{KEY}[{i}] '{spec}': listed twice: give it once (a weight scales it)")
    return [_load(spec, i, recipe_dir) for i, spec in enumerate(specs)]


def _load(spec: str, i: int, recipe_dir: str | Path | None) -> RewardFunc:
    where = f"{KEY}[{i}] '{spec}'"
    head, _, arg = str(spec).partition(":")
    if head in BUILTINS:
        return _builtin(spec, head, arg, where)
    target, _, name = str(spec).rpartition(":")
    if not target or not name:
        raise UserError(f"{where}: not a built-in ({', '.join(BUILTINS)}), path/to/file.py:function or "
                        "package.module:function")
    if target.endswith(".py"):
        module = _module_from_file(target, where, recipe_dir)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:  # noqa: BLE001 (anything the module raises on import is the user's to fix)
            raise UserError(f"{where}: cannot import module '{target}' ({type(e).__name__}: {_first_line(e)}): "
                            "check the name, or give path/to/file.py:function") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise UserError(f"{where}: '{target}' has no function '{name}' (functions: {', '.join(found) or 'none'})")
    return RewardFunc(spec, fn, _needed_columns(fn))


def _builtin(spec: str, head: str, arg: str, where: str) -> RewardFunc:
    factory, default, meaning = BUILTINS[head]
    if not arg and default is None:
        raise UserError(f"{where}: {head} needs {head}:{meaning}")
    if arg and default == "":
        raise UserError(f"{where}: {head} takes no argument: write {head}")
    if head == "length_penalty" and not (arg.isdigit() and int(arg) > 0):
        raise UserError(f"{where}: the token count must be an integer > 0, e.g. length_penalty:256")
    try:
        fn = factory(arg or default or "")
    except re.error as e:
        raise UserError(f"{where}: not a regular expression ({e})") from None
    column = (arg or default) if meaning == "COLUMN" else None
    return RewardFunc(spec, fn, (column,) if column else ())


def _module_from_file(target: str, where: str, recipe_dir: str | Path | None) -> Any:
    path = Path(target)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, *([Path(recipe_dir) / path] if recipe_dir else [])]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        tried = "" if path.is_absolute() else \
            " (a relative path is tried in the current directory, then the recipe's folder)"
        raise UserError(f"{where}: no file '{target}'{tried}")
    name = f"shardtune_reward_{abs(hash(str(found.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, found)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        del sys.modules[name]
        raise UserError(f"{where}: running '{found}' raised {type(e).__name__}: {_first_line(e)}") from None
    return module


def _needed_columns(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The columns a function names as parameters without defaults (TRL's accuracy_reward(completions, solution,
    **kwargs) needs `solution`): what check_reward_specs can refuse before a run."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return ()
    return tuple(p.name for p in params if p.name not in TRL_ARGS and p.default is p.empty
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_reward_specs(specs: Sequence[str], columns: Sequence[str], *,
                       recipe_dir: str | Path | None = None) -> list[RewardFunc]:
    """`validate`'s check: every spec loads, and every column a function needs is in the data. Returns the funcs."""
    funcs = load_reward_funcs(specs, recipe_dir=recipe_dir)
    for i, f in enumerate(funcs):
        missing = [c for c in f.columns if c not in columns]
        if missing:
            raise UserError(f"{KEY}[{i}] '{f.name}': reads column '{missing[0]}', which the data does not have "
                            f"(columns: {', '.join(sorted(columns)) or 'none'}): add it to the data or name another "
                            "column")
    return funcs


def reward_problem(recipe: Recipe) -> str | None:
    """`validate`'s and `train`'s (before any worker builds the model) check of train.objective=grpo: every spec
    loads (its file and function exist) and every column a function reads is in the head of the data."""
    from shardtune.data.check import reward_columns

    if recipe.train.objective != "grpo":
        return None
    try:
        columns = reward_columns(recipe.data)
    except UserError:  # unreadable data: the data checks say why; the specs are still checked
        columns = None
    try:
        if columns is None:
            load_reward_funcs(recipe.grpo.reward_funcs)
        else:
            check_reward_specs(recipe.grpo.reward_funcs, columns)
    except UserError as e:
        return str(e)
    return None


def score(funcs: Sequence[RewardFunc], weights: Sequence[float] | None, prompts: list[Any], completions: list[Any],
          columns: dict[str, list[Any]], *, completion_ids: list[list[int]] | None = None, step: int = 0,
          rows: Sequence[int] | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """Each function over the batch (one entry per completion: prompts and columns repeated per generation), and
    the weighted total per completion. `rows`: each completion's 0-based data row (PromptRow.source_row), named
    1-based in error lines as the data's own errors name rows (else the completion's index in the batch). A function that raises, returns the wrong count or a non-number is a UserError."""
    n = len(completions)
    assert len(prompts) == n and all(len(v) == n for v in columns.values()), "one prompt and row per completion"
    weights = list(weights) if weights is not None else [1.0] * len(funcs)
    assert len(weights) == len(funcs), "one weight per reward function"
    kwargs: dict[str, Any] = dict(columns)
    kwargs.update(prompts=prompts, completions=completions, trainer_state=SimpleNamespace(global_step=step),
                  log_extra=_ignore, log_metric=_ignore)
    if completion_ids is not None:
        kwargs["completion_ids"] = completion_ids
    per_func = {f.name: _call(f, kwargs, n, rows) for f in funcs}
    total = []
    for j in range(n):
        values = [(w * v[j]) for w, v in zip(weights, per_func.values()) if not math.isnan(v[j])]
        total.append(math.fsum(values) if values or not funcs else math.nan)  # TRL: all None -> unscorable (NaN)
    return total, per_func


def _ignore(*_: Any, **__: Any) -> None:
    return None


def _row(j: int, rows: Sequence[int] | None) -> str:
    return f"data row {rows[j] + 1}" if rows is not None else f"completion {j}"


def _call(f: RewardFunc, kwargs: dict[str, Any], n: int, rows: Sequence[int] | None) -> list[float]:
    where = f"reward function '{f.name}'"
    try:
        out = f.fn(**kwargs)
    except Exception as e:  # noqa: BLE001 (the user's code: any exception is a line naming it)
        j = _raising_row(f, kwargs, n)
        at = f" at {_row(j, rows)}" if j is not None else f" on a batch of {n} completions"
        raise UserError(f"{where} raised {type(e).__name__}{at}: {_first_line(e)}") from None
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) and not hasattr(out, "__len__"):
        raise UserError(f"{where} returned {type(out).__name__}, not a list: return one number per completion "
                        f"({n})")
    values = list(out)
    if len(values) != n:
        raise UserError(f"{where} returned {len(values)} values for {n} completions: return one number per "
                        "completion")
    result = []
    for j, v in enumerate(values):
        if v is None:  # TRL: not applicable to this completion
            result.append(math.nan)
            continue
        try:
            if isinstance(v, (str, bytes)):
                raise TypeError
            result.append(float(v))
        except (TypeError, ValueError):
            raise UserError(f"{where} returned {v!r} ({type(v).__name__}) at {_row(j, rows)}: return a number "
                            "(or None where it does not apply)") from None
    return result


def _raising_row(f: RewardFunc, kwargs: dict[str, Any], n: int) -> int | None:
    """The first completion on which the function raises alone: it runs again row by row, on the error path only.
    None when no single row raises (the batch as a whole fails)."""
    batched = ("prompts", "completions", "completion_ids", *(k for k in kwargs if k not in TRL_ARGS))
    for j in range(n):
        one = {k: ([v[j]] if k in batched else v) for k, v in kwargs.items()}
        try:
            f.fn(**one)
        except Exception:  # noqa: BLE001
            return j
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or ["no message"])[0][:200]
