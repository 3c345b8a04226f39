"""Schema fuzzing of kvboost-server: schemathesis generates requests from the app's own OpenAPI schema (bodies that
fit it and bodies that break it) and sends them to a live server over a real engine loop; no answer may be a 5xx.

Bounded: :data:`MAX_EXAMPLES` cases per operation and generation mode, a context of 128 tokens (so no generated
request decodes for long). The operations are driven with Hypothesis directly (``APIOperation.as_strategy``) rather
than through schemathesis' pytest plugin, whose lazy-fixture loader does not run under pytest 9."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from test_server import served

MAX_EXAMPLES = 25
OPERATIONS = ["GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}", "POST /v1/completions",
              "POST /v1/chat/completions", "POST /tokenize", "POST /v1/cache/warm"]  # fmt: skip


@pytest.fixture(scope="module")
def api_schema() -> Iterator[schemathesis.BaseSchema]:
    with served(max_model_len=128) as s:
        yield schemathesis.openapi.from_url(f"{s.base}/openapi.json")


def test_schema_lists_every_operation(api_schema):
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert set(OPERATIONS) <= labels, set(OPERATIONS) - labels


#: every operation with data that fits its schema; those that take a JSON body also with data that breaks it (the
#: others have no invalid request to generate: no parameters, or one free-form string)
CASES = [(label, GenerationMode.POSITIVE) for label in OPERATIONS] + [
    (label, GenerationMode.NEGATIVE) for label in OPERATIONS if label.startswith("POST")
]


@pytest.mark.parametrize("label,mode", CASES, ids=[f"{label}-{mode.value}" for label, mode in CASES])
def test_no_server_errors(api_schema, label, mode):
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, label

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, phases=[Phase.generate], database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=[not_a_server_error], timeout=60)

    fuzz()
