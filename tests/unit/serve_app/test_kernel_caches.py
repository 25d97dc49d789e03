import pytest

from serve_app.kernel_caches import KERNEL_CACHE_CAPACITY, bound_kernel_caches


def test_sets_both_capacities_when_unset(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert bound_kernel_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(KERNEL_CACHE_CAPACITY),
                                     "LRU_CACHE_CAPACITY": str(KERNEL_CACHE_CAPACITY)}


def test_the_environment_wins(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert bound_kernel_caches(16) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "512"}


def test_rejects_a_capacity_below_one():
    with pytest.raises(ValueError, match="capacity"):
        bound_kernel_caches(0)
