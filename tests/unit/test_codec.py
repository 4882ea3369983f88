"""canteen/codec/sampling.py: Sampling travels by field name, so every field must have a
same-named protobuf field, and a round trip must give back every value (float32-exact ones
here)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from canteen.codec import sampling_from_pb, sampling_from_request, sampling_to_pb
from canteen.plan import Constraint, Sampling
from canteen.v1 import common_pb2, inference_pb2

CONSTRAINTS = [
    None,
    Constraint("json_object"),
    Constraint("json_schema", text='{"type":"object"}'),
    Constraint("regex", text="[a-z]+"),
    Constraint("choice", choices=("yes", "no")),
    Constraint("grammar", text='start: "a"'),
]
# Every plain field away from its default, at values float32 holds exactly.
SET = Sampling(temperature=0.5, top_p=0.25, top_k=7, seed=2**64 - 3, top_logprobs=5)
PLAIN = [f.name for f in fields(Sampling) if f.name != "constraint"]


def test_every_sampling_field_has_a_same_named_proto_field() -> None:
    names = {f.name for f in fields(Sampling)}
    # the round trips below cover every field: none of them is left at its default
    assert all(getattr(SET, name) != getattr(Sampling(), name) for name in PLAIN)
    for message in (common_pb2.SamplingParams, inference_pb2.GenerateRequest):
        missing = names - set(message.DESCRIPTOR.fields_by_name)
        assert not missing, f"{message.DESCRIPTOR.name} lacks {missing}"


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind if c else "none")
def test_sampling_round_trips_through_sampling_params(constraint: Constraint | None) -> None:
    sampling = replace(SET, constraint=constraint)
    assert sampling_from_pb(sampling_to_pb(sampling)) == sampling
    assert sampling_from_pb(sampling_to_pb(Sampling(seed=9))) == Sampling(seed=9)


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind if c else "none")
def test_a_public_request_carries_every_field(constraint: Constraint | None) -> None:
    sampling = replace(SET, constraint=constraint)
    params = sampling_to_pb(sampling)
    request = inference_pb2.GenerateRequest(prompt="hi")
    for name in PLAIN:
        setattr(request, name, getattr(params, name))
    if constraint is not None:
        request.constraint.CopyFrom(params.constraint)
    assert sampling_from_request(request) == sampling


def test_unset_request_fields_take_the_domain_defaults_and_a_random_seed() -> None:
    got = sampling_from_request(inference_pb2.GenerateRequest(prompt="hi"))
    defaults = Sampling()
    assert (got.temperature, got.top_p, got.top_k, got.top_logprobs, got.constraint) == (
        defaults.temperature,
        defaults.top_p,
        defaults.top_k,
        defaults.top_logprobs,
        None,
    )
    assert 0 <= got.seed < 2**63
    # zero is a value, not "unset", for the fields with presence
    zero = sampling_from_request(inference_pb2.GenerateRequest(prompt="hi", temperature=0, seed=0))
    assert zero.temperature == 0.0 and zero.seed == 0
