"""Plugin configuration: a pydantic model per plugin (option syntax: ``treespec.options``)."""

from __future__ import annotations

from typing import Any

import pydantic


class PluginConfig(pydantic.BaseModel):
    """Base class of every builder's and drafter's ``Config``.

    Unknown options are an error (``extra="forbid"``); values given as strings on the command line
    are converted by pydantic's lax mode (``"25"`` -> ``25``).
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, data: Any) -> Any:
        """``True``/``False`` for an option that is not a bool: lax mode would read them as 1 and 0
        (``nodes=True`` became a budget of one node)."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and not _takes_bool(field.annotation):
                    raise ValueError(f"option {name!r} is not a yes/no option, got {value!r}")
        return data


def describe_options(config: type[PluginConfig]) -> list[dict[str, Any]]:
    """One record per option: name, type, default, description (for ``treespec plugins``)."""
    out = []
    for name, field in config.model_fields.items():
        ann = field.annotation
        type_name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        out.append(
            {
                "name": name,
                "type": type_name,
                "default": default,
                "required": field.is_required(),
                "description": field.description or "",
            }
        )
    return out


def build_config(config_cls: type[PluginConfig], options: dict[str, Any] | None, owner: str) -> PluginConfig:
    """Validate ``options`` against ``config_cls``; any problem becomes a one-line ConfigError."""
    from treespec.errors import ConfigError

    try:
        return config_cls.model_validate(dict(options or {}))
    except pydantic.ValidationError as exc:
        problems, fields = [], {}  # fields: option -> (its input, what each accepted type said)
        for err in exc.errors():
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown option {'.'.join(str(p) for p in err['loc'])!r}")
            elif not err["loc"]:  # a check across the options (PluginConfig's own validators)
                problems.append(str(err["msg"]).removeprefix("Value error, "))
            else:  # one message per option: a union (nodes: int > 0 or 'auto') fails once per member
                said = fields.setdefault(str(err["loc"][0]), (err.get("input"), []))[1]
                said.append(str(err["msg"]).removeprefix("Input ").removeprefix("Value error, "))
        for name, (value, said) in fields.items():
            problems.append(f"option {name!r}: {', or '.join(dict.fromkeys(said))} (got {value!r})")
        known = (
            ", ".join(
                f"{o['name']}={o['default']!r}" if not o["required"] else f"{o['name']} (required)"
                for o in describe_options(config_cls)
            )
            or "none"
        )
        raise ConfigError(f"{owner}: {'; '.join(problems)}. Valid options: {known}") from None


def _takes_bool(annotation: Any) -> bool:
    """Whether a field's type accepts a bool as such (bool, Any, or a union holding one of them)."""
    import typing

    if annotation is bool or annotation is Any or annotation is object:
        return True
    return any(_takes_bool(arg) for arg in typing.get_args(annotation))
