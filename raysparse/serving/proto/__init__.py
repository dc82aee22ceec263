"""Generated gRPC stubs of ``raysparse.proto`` (package ``raysparse.v1``), committed with the proto.

Regenerate from the repository root after editing the proto (grpcio-tools of the grpcio version pinned in
pyproject.toml):

    python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. \
        raysparse/serving/proto/raysparse.proto
"""
