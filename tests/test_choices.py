"""Each list of accepted values is written once, in meshkit/choices.py, and used everywhere."""

import pathlib
import re

import pytest

from meshkit import choices, config
from meshkit.data import sources as data
from meshkit.exchange import two_stage as exchange
from meshkit.model import moe

LISTS = {name: getattr(choices, name) for name in choices.__all__}


def test_the_modules_use_the_one_list():
    assert exchange.METHODS is choices.EXCHANGE_METHODS
    assert exchange.ORDERS is choices.EXCHANGE_ORDERS
    assert moe.DISPATCH_MODES is choices.DISPATCH_MODES
    assert data.DATASET_KINDS is choices.DATA_KINDS
    # The config's accepted values are the JSON schema's `enum` of each field.
    fields = {f"{s.section}.{name}": f.json_schema_extra or {} for s in (config.ExchangeConfig,
              config.ModelConfig, config.DataConfig, config.ParallelConfig)
              for name, f in s.model_fields.items()}
    assert fields["exchange.method"]["enum"] is choices.EXCHANGE_METHODS
    assert fields["exchange.order"]["enum"] is choices.EXCHANGE_ORDERS
    assert fields["model.dispatch"]["enum"] is choices.DISPATCH_MODES
    assert fields["model.dtype"]["enum"] is choices.DTYPES
    assert fields["data.kind"]["enum"] is choices.DATA_KINDS
    assert fields["parallel.context_method"]["enum"] is choices.CONTEXT_METHODS
    # A nullable field's enum admits null too (its default), after the list's values.
    assert fields["data.dtype"]["enum"] == (*choices.TOKEN_DTYPES, None)
    schema = config.json_schema()["$defs"]
    assert schema["ExchangeConfig"]["properties"]["method"]["enum"] == list(
        choices.EXCHANGE_METHODS)


@pytest.mark.parametrize("name", sorted(LISTS))
def test_no_module_spells_a_list_out_again(name):
    # Two of a list's values side by side in a tuple literal is a second copy of it.
    values = LISTS[name]
    quoted = [f"[\"']{re.escape(v)}[\"']" for v in values[:2]]
    pattern = re.compile(r"\(\s*" + r"\s*,\s*".join(quoted))
    package = pathlib.Path(choices.__file__).parent
    copies = [p.name for p in package.rglob("*.py")
              if p.name != "choices.py" and pattern.search(p.read_text())]
    assert copies == []
