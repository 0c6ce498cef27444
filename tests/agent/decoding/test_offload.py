"""agent.n_gpu_layers: every layer on the GPU where llama.cpp's own query says this build can offload (a CUDA
build on the Orin), none where it cannot (this machine's CPU wheel), and the choice reported at start."""

import logging

import pytest

from agent.app import config
from agent.decoding.drafter import Drafter, gpu_layers


def test_gpu_layers_follow_llama_cpps_own_answer():
    assert gpu_layers(-1, supported=True) == -1 and gpu_layers(12, supported=True) == 12
    assert gpu_layers(-1, supported=False) == 0 and gpu_layers(0, supported=True) == 0


class Loaded(Exception):
    pass


@pytest.mark.parametrize("supported,want", [(True, -1), (False, 0)])
def test_drafter_asks_llama_cpp_and_passes_the_layers(monkeypatch, caplog, supported, want):
    import llama_cpp

    seen = {}

    def fake_llama(path, **kw):
        seen.update(kw)
        raise Loaded  # what follows needs a real model; the layers are what this checks

    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: supported)
    monkeypatch.setattr(llama_cpp, "Llama", fake_llama)
    with caplog.at_level(logging.WARNING, "agent.decoding.drafter"), pytest.raises(Loaded):
        Drafter(threads=1)
    assert seen["n_gpu_layers"] == want
    assert ("no GPU offload" in caplog.text) == (not supported)


def test_config_default_is_all_layers_and_rejects_nonsense():
    assert config.load(None).agent.n_gpu_layers == -1
    with pytest.raises(config.ConfigError, match="n_gpu_layers"):
        config.load(None, ["agent.n_gpu_layers=-2"])


@pytest.mark.real
def test_the_real_draft_reports_where_it_runs(drafter):
    import llama_cpp

    offload = drafter.offload
    assert offload["llama_supports_gpu_offload"] == bool(llama_cpp.llama_supports_gpu_offload())
    assert offload["device"] == ("gpu" if offload["llama_supports_gpu_offload"] else "cpu")
