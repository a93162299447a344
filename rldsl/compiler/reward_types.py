"""The value type of a reward stage's `fn`: one function, or named components with weights."""

from typing import NamedTuple

from rldsl.compiler import ast
from rldsl.compiler.diagnostics import Diagnostic, Span
from rldsl.compiler.types import INVALID, Float, Result, Str, _err, _shown


class RewardComponent(NamedTuple):
    """One named, weighted reward of a reward stage's `fn` list."""

    name: str
    fn: str  # `module:function`
    weight: float
    span: Span


class RewardFns:
    """A reward stage's `fn`: one `"module:function"`, or named components
    summed with weights, `[correct("m:f"), format("m:g", weight = 0.1)]`."""

    describe = 'a `"module:function"` or a list of named components such as `[correct("m:f", weight = 1.0)]`'
    _EXAMPLE = 'fn = [correct("rldsl.rewards:exact_match"), format("my_rewards:tagged", weight = 0.1)]'

    def __init__(self, reference: Str):
        self.reference = reference  # one function's `module:function`
        self.weight = Float()

    def convert(self, value: ast.Value) -> Result:
        if not isinstance(value, ast.ListValue):
            return self.reference.convert(value)
        if not value.items:
            return INVALID, _err("RLP104", "an empty reward list", value.span, f"name at least one: {self._EXAMPLE}")
        components, diags = [], []
        for item in value.items:
            component, errs = self._component(item)
            diags += errs
            if component is not None and any(c.name == component.name for c in components):
                diags += _err("RLP102", f"reward component `{component.name}` given twice", component.span,
                              "give each component its own name")
            elif component is not None:
                components.append(component)
        return (INVALID if diags else tuple(components)), diags

    def _component(self, item: ast.Value) -> tuple[RewardComponent | None, list[Diagnostic]]:
        if not isinstance(item, ast.Call):
            return None, _err("RLP104", f"expected a named reward component, found {_shown(item)}", item.span,
                              f"write each as `name(\"module:function\", weight = 1.0)`: {self._EXAMPLE}")
        name, fn, weight, diags = item.func.text, INVALID, 1.0, []
        for arg in item.args:
            if arg.name is None and fn is INVALID:
                fn, errs = self.reference.convert(arg.value)
                diags += errs
            elif arg.name is not None and arg.name.text == "weight":
                weight, errs = self.weight.convert(arg.value)
                diags += errs
            else:
                shown = f"`{arg.name.text}`" if arg.name else "a second positional argument"
                diags += _err("RLP103", f"reward component `{name}` takes no {shown}", arg.span,
                              f'write `{name}("module:function", weight = 1.0)`')
        if fn is INVALID and not diags:
            diags += _err("RLP104", f"reward component `{name}` names no function", item.span,
                          f'write `{name}("module:function")`, for example `{name}("rldsl.rewards:exact_match")`')
        if diags:
            return None, diags
        return RewardComponent(name, fn, weight, item.span), []
