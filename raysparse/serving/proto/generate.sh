#!/usr/bin/env bash
# Regenerates the committed stubs of raysparse.proto (run after editing the proto; needs PyPI and a Python
# of at most 3.12, for which grpcio-tools 1.62 has wheels). They must import under every grpcio and
# protobuf that pyproject.toml allows (grpcio >= 1.66, protobuf >= 5.27.2, < 8), so two generators:
#   raysparse_pb2.py, raysparse_pb2.pyi  grpcio-tools 1.62.3 (protoc 25.1): messages without a protobuf
#       runtime check. protoc 26 and later write ValidateProtobufRuntimeVersion, which refuses a runtime two
#       majors away, and no one gencode version passes it under both protobuf 5 and 7.
#   raysparse_pb2_grpc.py  grpcio-tools 1.66.0: its GRPC_GENERATED_VERSION guard is 1.66.0, the declared
#       floor (grpcio-tools 1.85 writes 1.85.1 and the package then fails to import under grpcio 1.84).
# tests/test_grpc_floor.py checks both against pyproject.toml and imports them under the floor.
set -euo pipefail
cd "$(dirname "$0")/../../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/messages" && "$tmp/messages/bin/pip" install -q grpcio-tools==1.62.3
python3 -m venv "$tmp/stubs" && "$tmp/stubs/bin/pip" install -q grpcio-tools==1.66.0
"$tmp/messages/bin/python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. raysparse/serving/proto/raysparse.proto
"$tmp/stubs/bin/python" -m grpc_tools.protoc -I . --grpc_python_out=. raysparse/serving/proto/raysparse.proto
