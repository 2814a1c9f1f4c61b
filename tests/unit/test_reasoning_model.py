"""The thinking model is cached under a key of its recipe and its transcripts, apart from the tiny model."""

from __future__ import annotations

import shutil
from pathlib import Path

from simulate.vllm import server


def test_a_changed_transcript_names_a_new_thinking_model(tmp_path: Path) -> None:
    recipe = [Path(shutil.copy(path, tmp_path)) for path in server.THINKING_RECIPE]
    before = server.recipe_hash(*recipe)
    assert before == server.recipe_hash(*server.THINKING_RECIPE)
    recipe[1].write_text(recipe[1].read_text().replace("Why does the node drain first?", "Why drain?"))
    assert server.recipe_hash(*recipe) != before
    assert server.recipe_hash() == server.recipe_hash(server.RECIPE) != before


def test_a_built_model_is_found_in_the_cache_without_building_it(tmp_path: Path) -> None:
    key = server.recipe_hash(*server.THINKING_RECIPE)
    model = tmp_path / "models" / f"thinking-llama-{key}"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    assert server.thinking_model(tmp_path) == model  # no vLLM venv under tmp_path: nothing was run
