"""The .proto contract: field numbers never move, and the shapes other helpers and clients rely on hold.

proto/specwire/v1/fields.lock lists every field and enum value with its number and type. Fields may only
be added (then appended to the lock); a renumbered, retyped or removed entry breaks wire compatibility.
"""

from pathlib import Path

from specwire.v1 import drafter_pb2, frontend_pb2, generation_pb2

LOCK = Path(__file__).resolve().parents[1] / "proto" / "specwire" / "v1" / "fields.lock"


def _current_entries() -> list[str]:
    entries = []
    for module in (generation_pb2, drafter_pb2, frontend_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            for f in message.fields:
                label = "repeated" if f.is_repeated else "single"
                entries.append(f"{message.full_name}.{f.name} = {f.number} type={f.type} {label}")
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            entries.extend(f"{enum.full_name}.{v.name} = {v.number}" for v in enum.values)
    return entries


def test_field_numbers_are_append_only():
    locked = [line for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]
    current = _current_entries()
    missing = sorted(set(locked) - set(current))
    assert not missing, f"renumbered, retyped or removed (wire-incompatible): {missing}"
    unlocked = sorted(set(current) - set(locked))
    assert not unlocked, f"new fields: append these lines to {LOCK.name}: {unlocked}"


def test_unset_enums_are_invalid_not_a_default():
    # A forgotten probs_kind must not read as "no probabilities" (q = 1), nor a forgotten dtype as float32.
    assert drafter_pb2.ProbsKind.Name(0) == "PROBS_KIND_UNSPECIFIED"
    assert drafter_pb2.DType.Name(0) == "DTYPE_UNSPECIFIED"
    assert generation_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"


def test_optional_sampling_fields_have_presence():
    params = generation_pb2.SamplingParams()
    for name in ("top_p", "seed", "max_tokens"):
        assert not params.HasField(name)
    params.seed = 0
    assert params.HasField("seed"), "seed 0 must be distinguishable from no seed"
    want = drafter_pb2.DraftWant(seed=0)
    assert want.HasField("seed")


def test_service_shapes():
    generation = generation_pb2.DESCRIPTOR.services_by_name["Generation"].methods_by_name
    assert (generation["Generate"].client_streaming, generation["Generate"].server_streaming) == (False, True)
    assert not generation["Abort"].server_streaming and not generation["GetModelInfo"].server_streaming
    drafter = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].methods_by_name
    assert (drafter["Draft"].client_streaming, drafter["Draft"].server_streaming) == (True, True)
    assert drafter["Handshake"].output_type.name == "HandshakeResponse"


def test_prompt_and_events_are_oneofs():
    request = generation_pb2.GenerateRequest(text="hi")
    request.token_ids.ids.extend([1, 2])
    assert request.WhichOneof("prompt") == "token_ids"
    update = drafter_pb2.RequestUpdate(request_id="a", free=drafter_pb2.Free())
    assert update.WhichOneof("kind") == "free"
    assert generation_pb2.GenerateResponse(error=generation_pb2.Error()).WhichOneof("event") == "error"
