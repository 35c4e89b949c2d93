"""bench/routing_shift_data: a shifted family is one installed package or several (comma-separated), keyed by
'+'-joined names for its caches and results, its modules split by module between traffic and evaluation."""

from __future__ import annotations

import pytest

from bench.routing_shift_data import CACHE_ROOT, cache_dir, family_key, family_modules, packages_of, side_of


def test_a_family_of_several_packages_holds_each_ones_modules_under_one_key():
    assert packages_of(" click, jinja2 ") == ["click", "jinja2"]
    assert family_key("click,jinja2") == "click+jinja2"
    assert cache_dir("click,jinja2") == CACHE_ROOT / "click+jinja2"
    both = family_modules("click,jinja2")
    names = [n for n, _ in both]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert {n.split(".")[0] for n in names} == {"click", "jinja2"}
    assert len(both) == len(family_modules("click")) + len(family_modules("jinja2"))
    assert not any(".tests." in n or n.split(".")[-1].startswith("test_") for n in names)
    assert {side_of(n) for n in names} == {"traffic", "eval"}
    with pytest.raises(SystemExit, match="not installed"):
        family_modules("click,no_such_package_here")
