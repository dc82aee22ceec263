"""Generated gRPC stubs of ``raysparse.proto`` (package ``raysparse.v1``), committed with the proto.

They import under every grpcio and protobuf that pyproject.toml allows (grpcio >= 1.66, protobuf
>= 5.27.2, < 8): the messages come from grpcio-tools 1.62.3 (protoc 25.1, no protobuf runtime version
check) and the service stubs from grpcio-tools 1.66.0 (a grpcio guard at the 1.66.0 floor). Regenerate both
from the repository root after editing the proto (needs PyPI and a Python of at most 3.12):

    bash raysparse/serving/proto/generate.sh

which runs, each in a throwaway venv with that grpcio-tools,

    python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. raysparse/serving/proto/raysparse.proto
    python -m grpc_tools.protoc -I . --grpc_python_out=. raysparse/serving/proto/raysparse.proto

``tests/test_grpc_floor.py`` checks the stubs against the floors and imports them under the lowest versions.
"""
