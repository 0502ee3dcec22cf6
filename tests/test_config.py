"""The table of what each stored result depends on (tasks.config.OPTIONS) against the configuration."""
from __future__ import annotations

from pydantic import BaseModel

from wsseg.tasks.config import (ADDED_OPTIONS, OPTIONS, REMOVED_OPTIONS, ROUND_SETTINGS, Scope, WSSSConfig,
                                changed_fields, options_with, scope_of, with_added_options, without_removed)


def _paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        out.add(prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out |= _paths(field.annotation, f"{prefix}{name}.")
    return out


def test_every_row_names_a_field_or_a_removed_option_and_every_field_has_a_scope():
    fields = _paths(WSSSConfig)
    assert not [p for p in OPTIONS if p not in fields and p not in REMOVED_OPTIONS]
    # a field without a row falls under Scope.ALL (the stated default), or under its section's row
    assert all(isinstance(scope_of(p), Scope) for p in fields)
    assert scope_of("features.region_size") is Scope.ALL and scope_of("segmentation.epochs") is Scope.MODEL
    # every scope but the default names at least one option, and a removed option names no field
    assert {s for s, _ in OPTIONS.values()} == set(Scope) - {Scope.ALL}
    assert not set(REMOVED_OPTIONS) & fields and not set(ADDED_OPTIONS) - fields - set(REMOVED_OPTIONS)
    for final, rounds in ROUND_SETTINGS.items():
        assert scope_of(f"segmentation.{final}") is Scope.FINAL_MODEL and f"segmentation.{rounds}" in fields
    assert all(why for _, why in OPTIONS.values())


def test_what_the_code_reads_of_the_table():
    assert options_with(Scope.RUNTIME, under="") == ("device",)
    assert set(options_with(Scope.MODEL, Scope.DECISION, under="")) == {"segmentation", "epsilon", "stopping"}
    assert set(options_with(Scope.FROM_ROUND_1, under="")) == {"prelim_normalize", "prior_weight", "prior_source"}
    assert set(options_with(Scope.CAM_READING, under="classifier")) == {
        "cam_scales", "cam_mode", "cam_temperature", "cam_centring", "background_threshold", "background_rule"}


def test_a_record_of_a_removed_option_resumes_at_the_kept_value_and_recomputes_at_another():
    now = WSSSConfig().model_dump(mode="json")
    kept = {"prior_source": "labels", "classifier": {**now["classifier"], "cam_mode": "auto",
                                                     "background_rule": "tag_count", "cam_centring": 1.0},
            "mil": {**now["mil"], "hidden": 0, "min_share": 0.0, "negatives": "first_round"},
            "segmentation": {**now["segmentation"], "final_model": "full_budget"}}
    assert changed_fields({**now, **kept}, now) == []
    assert changed_fields({**now, **kept, "prior_source": "cam"}, now) == ["prior_source"]
    other = {**kept["classifier"], "background_rule": "constant"}
    assert changed_fields({**now, **kept, "classifier": other}, now) == ["classifier"]
    # lacking an option both added and removed: its value before it came
    lacking = {**now, **kept, "classifier": {k: v for k, v in other.items() if k != "background_rule"}}
    lacking.pop("prior_source")
    assert changed_fields(with_added_options(lacking, removed=True), now) == ["classifier", "prior_source"]
    # loads as today's configuration
    assert WSSSConfig.model_validate(without_removed({**now, **kept, "stopping": "auto"})) == WSSSConfig()
