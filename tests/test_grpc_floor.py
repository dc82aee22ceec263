"""The dependency floor: the committed gRPC stubs work with every grpcio and protobuf pyproject.toml allows.

The fast tests read the stubs' version guards against the declared floors (and the stubs against the proto,
so an edit without regenerating shows); the slow one installs the lowest declared versions into a throwaway
venv and serves and calls the stubs there. Regenerate with ``raysparse/serving/proto/generate.sh``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "raysparse" / "serving" / "proto"
GRPC_PACKAGES = ("grpcio", "grpcio-health-checking", "grpcio-reflection")


def declared() -> dict[str, Requirement]:
    """pyproject.toml's requirements of the gRPC packages and protobuf, by name."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert deps, "pyproject.toml has no dependencies list"
    reqs = [Requirement(r) for r in re.findall(r'"([^"]+)"', deps.group(1))]
    return {r.name: r for r in reqs if r.name in (*GRPC_PACKAGES, "protobuf")}


def floor(req: Requirement) -> Version:
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert lows, f"{req} declares no lower bound"
    return max(lows)


def cap_major(req: Requirement) -> int:
    """The highest major version the requirement allows (it must have a ``<`` bound)."""
    highs = [Version(s.version) for s in req.specifier if s.operator == "<"]
    assert highs, f"{req} declares no upper bound"
    top = min(highs)
    return top.major - 1 if (top.minor, top.micro) == (0, 0) else top.major


def test_floors_reach_down_to_grpcio_1_66():
    reqs = declared()
    assert set(reqs) == {*GRPC_PACKAGES, "protobuf"}
    for name in GRPC_PACKAGES:
        assert floor(reqs[name]) <= Version("1.66"), reqs[name]
    # grpcio-health-checking and -reflection 1.66's own messages are protobuf 5.27.2 gencode
    assert floor(reqs["protobuf"]) == Version("5.27.2")


def test_stubs_carry_no_version_guard_above_the_declared_floors():
    """``raysparse_pb2_grpc`` refuses a grpcio older than its GRPC_GENERATED_VERSION, and protobuf gencode
    from protoc 26 on refuses a runtime of an older version or of a major more than one newer: neither may
    refuse a version pyproject.toml allows."""
    reqs = declared()
    stubs = (PROTO / "raysparse_pb2_grpc.py").read_text()
    guard = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", stubs, re.M)
    if guard:
        assert Version(guard.group(1)) <= floor(reqs["grpcio"]), guard.group(0)
    messages = (PROTO / "raysparse_pb2.py").read_text()
    check = re.search(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+),", messages)
    if check:
        gen = Version(".".join(check.groups()))
        low = floor(reqs["protobuf"])
        assert gen <= low and gen.major == low.major, f"gencode {gen} refuses protobuf {low}"
        assert cap_major(reqs["protobuf"]) <= gen.major + 1, f"gencode {gen} refuses protobuf {reqs['protobuf']}"


def test_stubs_match_the_proto():
    """Every message and field of raysparse.proto is in the generated descriptor, with its number: an edit
    to the proto without ``generate.sh`` shows here."""
    from raysparse.serving.proto import raysparse_pb2 as pb
    from raysparse.serving.proto import raysparse_pb2_grpc as stubs

    text = re.sub(r"//[^\n]*", "", (PROTO / "raysparse.proto").read_text())
    messages = re.findall(r"^message (\w+) \{(?:\}|(.*?)^\})", text, re.S | re.M)
    assert len(messages) > 10
    for name, body in messages:
        fields = {f: int(n) for f, n in re.findall(r"(\w+)\s*=\s*(\d+)\s*;", body)}
        desc = pb.DESCRIPTOR.message_types_by_name.get(name)
        assert desc is not None, f"message {name} is not in raysparse_pb2: run generate.sh"
        assert {f.name: f.number for f in desc.fields} == fields, f"{name} differs from the proto"
    service = re.search(r"^service RaySparse \{(.*?)^\}", text, re.S | re.M)
    assert service
    for rpc in re.findall(r"rpc (\w+)\(", service.group(1)):
        assert hasattr(stubs.RaySparseServicer, rpc), rpc


FLOOR_CHECK = textwrap.dedent("""
    import sys
    from concurrent import futures

    import google.protobuf
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from raysparse.serving.proto import raysparse_pb2 as pb
    from raysparse.serving.proto import raysparse_pb2_grpc as stubs

    class Servicer(stubs.RaySparseServicer):
        def GetModelInfo(self, request, context):
            return pb.ModelInfo(model="floor", layers=2, methods=["dense"])

        def Generate(self, request, context):
            yield pb.GenerateResponse(request_id=request.request_id, delta=pb.TokenDelta(token_ids=[1, 2]))
            yield pb.GenerateResponse(request_id=request.request_id, finish=pb.Finish(finish_reason="length"))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    stubs.add_RaySparseServicer_to_server(Servicer(), server)
    checker = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    checker.set("raysparse.v1.RaySparse", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(("raysparse.v1.RaySparse", reflection.SERVICE_NAME), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = stubs.RaySparseStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            assert (info.model, list(info.methods)) == ("floor", ["dense"]), info
            req = pb.GenerateRequest(text="hi", request_id="r1")
            req.method_params.update({"density": 0.1})
            out = list(stub.Generate(req, timeout=30))
            assert [m.WhichOneof("kind") for m in out] == ["delta", "finish"], out
            assert list(out[0].delta.token_ids) == [1, 2] and out[1].finish.finish_reason == "length"
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="raysparse.v1.RaySparse"), timeout=30).status
            assert status == health_pb2.HealthCheckResponse.SERVING, status
    finally:
        server.stop(None)
    print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__)
""")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stubs_serve_and_call_under_the_lowest_declared_versions(tmp_path):
    """A throwaway venv with exactly the declared floors of grpcio, grpcio-health-checking,
    grpcio-reflection and protobuf (nothing else): the stubs import, a server with health and reflection
    serves them, and a client stub calls a unary and a streaming method over a loopback channel."""
    reqs = declared()
    pins = [f"{name}=={floor(reqs[name])}" for name in (*GRPC_PACKAGES, "protobuf")]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, f"pip install {' '.join(pins)} failed:\n{install.stderr[-3000:]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(ROOT)  # raysparse's package __init__s import nothing beyond the stubs' needs
    proc = subprocess.run([str(py), "-W", "error", "-c", FLOOR_CHECK], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = re.search(r"grpcio (\S+) protobuf (\S+)", proc.stdout)
    assert got, proc.stdout
    assert (Version(got.group(1)), Version(got.group(2))) == (floor(reqs["grpcio"]), floor(reqs["protobuf"]))
