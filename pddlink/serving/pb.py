"""The sidecar protocol's generated modules, typed (``pb2``: messages; ``pb2_grpc``: stubs and
servicers). Importing this raises ``Unavailable`` with what to run when they are not generated."""

from pddlink.serving.rpc import require_generated

require_generated()

from pddlink.serving.proto_gen import pddlink_sidecar_pb2 as pb2  # noqa: E402
from pddlink.serving.proto_gen import pddlink_sidecar_pb2_grpc as pb2_grpc  # noqa: E402

__all__ = ["pb2", "pb2_grpc"]
