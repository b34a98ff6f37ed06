"""Recipe loading: path or bundled name -> YAML + key=value overrides -> validated, frozen `Recipe`.

Every failure becomes a `UserError` whose one line names the key or file and a fix.
"""
from __future__ import annotations

import difflib
import functools
import re
from dataclasses import fields, is_dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf import __version__ as omegaconf_version
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

from shardtune.bundled import DATA_DIR, RECIPES_DIR
from shardtune.config.keys import schema_keys
from shardtune.config.model_folder import apply_model_folder
from shardtune.config.overrides import SAFE_LOADER, check_section_value, parse_overrides
from shardtune.config.schema import Recipe
from shardtune.errors import UserError
from shardtune.hub import is_hub_id

# Keys that name files; relative values resolve against the cwd, then the recipe's folder, then the bundled data
# (so `configs/models/llama-3.1-8b.json` names a shipped config from any recipe, anywhere).
PATH_KEYS = ("model.config", "model.path", "model.tokenizer", "data.path")

if not OmegaConf.has_resolver("now"):  # ${now:%Y%m%d-%H%M%S}; resolved once by the launcher, not per worker
    # omegaconf 2.4 renamed register_new_resolver to register_resolver; 2.3's register_resolver is the legacy API.
    # Each release warns (on stderr, before any one-line error) when given the other one.
    _legacy = tuple(int(x) for x in omegaconf_version.split(".")[:2]) < (2, 4)
    _register = OmegaConf.register_new_resolver if _legacy else OmegaConf.register_resolver
    _register("now", lambda fmt="%Y%m%d-%H%M%S": datetime.now().strftime(fmt))


def list_bundled_recipes() -> dict[str, Path]:
    """Name -> path for every YAML under recipes/, sub-folders included."""
    return {p.stem: p for p in sorted(RECIPES_DIR.rglob("*.yaml"))}


def resolve_recipe_path(recipe: str | Path) -> Path:
    path = Path(recipe)
    if path.is_file():
        return path.resolve()
    bundled = list_bundled_recipes()
    if str(recipe) in bundled:
        return bundled[str(recipe)]
    hint = difflib.get_close_matches(str(recipe), bundled, n=1)
    fix = f"did you mean '{hint[0]}'?" if hint else "run `shardtune recipes` to list bundled ones"
    raise UserError(f"recipe '{recipe}' is neither a file nor a bundled recipe: {fix}")


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        out.append(key)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            out.extend(_all_keys(type(default), key + "."))
    return out


def recipe_keys() -> list[str]:
    """Every dotted recipe key (the public surface; a test snapshots it)."""
    return _all_keys(Recipe)


def _friendly(err: Exception, source: str) -> UserError:
    """Turn an OmegaConf/validation error into one line naming the key."""
    key = getattr(err, "full_key", None) or ""
    msg = str(err).splitlines()[0]
    if isinstance(err, ConfigKeyError) or "not in" in msg or "Key '" in msg and "not" in msg:
        bad = key or (re.findall(r"Key '([^']+)'", msg) or ["?"])[0]
        hint = difflib.get_close_matches(bad, recipe_keys(), n=1)
        fix = (f"did you mean '{hint[0]}'? " if hint else "") + "(`shardtune keys` lists every key)"
        return UserError(f"{source}: unknown recipe key '{bad}': {fix}")
    if isinstance(err, InterpolationResolutionError):
        return UserError(f"{source}: key '{key}': cannot resolve interpolation ({msg})")
    if key in _ONE_COLUMN and "ListConfig" in msg:  # Alpaca's instruction + input as one list of fields
        return UserError(f"{source}: key '{key}' names one column, got a list: put the extra context's column in "
                         "data.input_field (format=instruction), or combine the columns in the file")
    if "is not a ListConfig" in msg and key:  # a list key given one value, e.g. `q_proj,v_proj` unbracketed
        items = [str(x).strip() for x in str(getattr(err, "value", "")).split(",") if str(x).strip()] or ["..."]
        fix = (f"{key}=[{','.join(items)}]" if source == "override" else
               f"{key.rsplit('.', 1)[-1]}: [{', '.join(items)}]")
        return UserError(f"{source}: key '{key}' takes a list, got {getattr(err, 'value', None)!r}: write {fix} "
                         "(a YAML list, in brackets)")
    wanted = re.search(r"could not be converted to (Float|Integer)|is not a valid (bool)", msg)
    if wanted and key:
        return _wrong_type(msg, key, source, wanted.group(1) or wanted.group(2))
    if key:
        return UserError(f"{source}: key '{key}': {msg}")
    return UserError(f"{source}: {msg}")


_TAKES = {"Float": "a number", "Integer": "a whole number", "bool": "true or false"}


def _wrong_type(msg: str, key: str, source: str, wanted: str) -> UserError:
    """A value OmegaConf cannot convert ("Value 'abc' of type 'str' could not be converted to Float"): what the key
    takes, and its default as a value that parses (none where the default is null)."""
    got = (re.findall(r"Value '(.*?)' (?:of type|is not)", msg) or ["?"])[0]
    default = next((k.default for k in schema_keys() if k.key == key), "null")
    fix = (f"`shardtune keys {key}` says what it means" if default == "null" else
           f"write e.g. {key}={default} (its default)" if source == "override" else
           f"write e.g. {key.rsplit('.', 1)[-1]}: {default} (its default)")
    return UserError(f"{source}: key '{key}' takes {_TAKES[wanted]}, got '{got}': {fix}")


_ONE_COLUMN = ("data.prompt_field", "data.response_field", "data.input_field", "data.text_field",
               "data.messages_field", "data.chosen_field", "data.rejected_field")


def _path_keys(cfg: DictConfig) -> list[str]:
    """PATH_KEYS, with `data.path` as `data.path[i].path` when it is a list of datasets."""
    data_path = OmegaConf.select(cfg, "data.path")
    if not isinstance(data_path, ListConfig):
        return list(PATH_KEYS)
    items = [f"data.path[{i}].path" for i, e in enumerate(data_path) if isinstance(e, DictConfig) and "path" in e]
    return [k for k in PATH_KEYS if k != "data.path"] + items


def _resolve_paths(cfg: DictConfig, recipe_dir: Path) -> None:
    for key in _path_keys(cfg):
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        if str(value).startswith("builtin:"):
            _check_builtin(key, str(value))
            continue
        p = Path(str(value)).expanduser()
        candidates = [p] if p.is_absolute() else [Path.cwd() / p, recipe_dir / p, DATA_DIR / p]
        found = next((c for c in candidates if c.exists()), None)
        if found is None and (key == "model.path" or key.startswith("data.path")) and is_hub_id(value):
            continue  # a Hugging Face repo id (hub.py): fetched into the HF cache where it is needed
        if found is None and "://" in str(value):
            raise UserError(f"{key}: '{value}' is a URL: shardtune reads local paths and Hugging Face repo ids "
                            "(OWNER/NAME); download the file and give its path")
        if found is None:
            raise UserError(f"{key}: file or folder '{value}' does not exist: fix the path (relative paths are "
                            f"tried against the cwd, the recipe's folder and shardtune's bundled {DATA_DIR})")
        OmegaConf.update(cfg, key, str(found.resolve()))


def _resolve_reward_files(cfg: DictConfig, recipe_dir: Path) -> None:
    """grpo.reward_funcs' `path/to/file.py:function`: a relative file found in the cwd, then the recipe's folder
    (trainer/rewards.py's order), becomes its absolute path, as data.path does, so that the workers (which read the
    run's recipe.yaml, not the recipe) and a resume from elsewhere load the file validate checked. A file found in
    neither is left as written: validate and train refuse it in one line (trainer/rewards.py reward_problem)."""
    funcs = OmegaConf.select(cfg, "grpo.reward_funcs")
    if not isinstance(funcs, ListConfig):
        return
    for i, spec in enumerate(funcs):
        target, _, name = str(spec).rpartition(":")
        if not target.endswith(".py") or Path(target).is_absolute():
            continue
        found = next((c for c in (Path.cwd() / target, recipe_dir / target) if c.is_file()), None)
        if found is not None:
            funcs[i] = f"{found.resolve()}:{name}"


def _check_builtin(key: str, value: str) -> None:
    from shardtune.synthetic import names as builtin_names

    name = value.split(":", 1)[1]
    known = {"data.path": builtin_names(), "model.tokenizer": ["char"]}.get(key.split("[")[0], [])
    if name not in known:
        raise UserError(f"{key}: unknown '{value}': choose from {['builtin:' + k for k in known]} or a path")


@functools.cache
def _schema() -> DictConfig:
    """The recipe schema with its defaults (a third of a recipe's load time to build)."""
    return OmegaConf.structured(Recipe)


def load_recipe_config(recipe: str | Path, overrides: list[str] = ()) -> DictConfig:
    """The merged, interpolated, path-resolved and validated recipe as a DictConfig (for saving)."""
    return _load(recipe, overrides)[0]


def _load(recipe: str | Path, overrides: list[str]) -> tuple[DictConfig, Recipe]:
    path = resolve_recipe_path(recipe)
    try:
        raw = _parse_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{path}: {_yaml_problem(e)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a recipe must be a YAML mapping of sections (model:, train:, ...)")
    for key, value in raw.items():
        check_section_value(str(key), value, str(path))
    try:
        cfg = OmegaConf.merge(_schema(), OmegaConf.create(raw))  # merge copies: the cached schema stays untouched
    except OmegaConfBaseException as e:
        raise _friendly(e, str(path)) from None
    try:
        cfg = OmegaConf.unsafe_merge(cfg, parse_overrides(list(overrides)))  # cfg is the first merge's copy
    except OmegaConfBaseException as e:
        raise _friendly(e, "override") from None
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise _friendly(e, str(path)) from None
    _resolve_paths(cfg, path.parent)
    _resolve_reward_files(cfg, path.parent)
    apply_model_folder(cfg, list(overrides))  # model.path=DIR brings its config and tokenizer
    try:
        return cfg, to_recipe(cfg, str(path))  # validates ranges and conflicts
    except UserError as e:  # a bad value given on the command line is the command line's fault, not the file's
        key = _offending_override(str(e), str(path), list(overrides))
        if key is None:
            raise
        raise UserError(f"override {key}: {str(e)[len(str(path)) + 2:]}") from None


def _offending_override(message: str, source: str, overrides: list[str]) -> str | None:
    """The KEY=VALUE override whose key the validation message starts with ("SOURCE: key: ..."), if any."""
    if not message.startswith(source + ": "):
        return None
    named = message[len(source) + 2:].split(":", 1)[0].split(" ", 1)[0].split("[", 1)[0]
    for o in overrides:
        if o.split("=", 1)[0].lstrip("+~") == named:
            return o
    return None


def _parse_yaml(text: str) -> Any:
    """libyaml's safe loader (a recipe is parsed on every load); on an error, PyYAML's own, whose messages name the
    character at fault (a tab) where libyaml's do not."""
    try:
        return yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError:
        return yaml.safe_load(text)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML syntax error as 'line L, column C: problem: fix', naming a tab (YAML forbids tabs in indentation)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if "\\t" in problem or "tab" in problem:
        return f"{where}not valid YAML ({problem}): indent with spaces, not tabs"
    return f"{where}not valid YAML ({problem}): fix the syntax"


def to_recipe(cfg: DictConfig, source: str = "recipe") -> Recipe:
    try:
        recipe = OmegaConf.to_object(cfg)  # runs every __post_init__
        recipe.check()
        return recipe
    except ValueError as e:  # our range checks, already "key: message"
        raise UserError(f"{source}: {e}") from None
    except OmegaConfBaseException as e:
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else None
        if cause is not None and not isinstance(cause, OmegaConfBaseException):
            raise UserError(f"{source}: {cause}") from None
        raise _friendly(e, source) from None


def load_recipe(recipe: str | Path, overrides: list[str] = ()) -> Recipe:
    return _load(recipe, overrides)[1]


def to_yaml(cfg: DictConfig | Recipe) -> str:
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    return OmegaConf.to_yaml(cfg)


def bundled_description(path: Path) -> str:
    try:
        data: Any = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return "(invalid YAML)"
    return str(data.get("description", "")) if isinstance(data, dict) else ""
