#!/usr/bin/env python3
"""Container health check: is the feeder on this host SERVING (grpc.health.v1)?

    tokenfeed-healthcheck [HOST:PORT]      # default 127.0.0.1:$TOKENFEED_PORT (50051)

Exit 0 when the health service answers SERVING, 1 otherwise (NOT_SERVING while the
feeder drains on SIGTERM, unreachable, or timed out), as Docker's HEALTHCHECK expects.
Why a script rather than grpc_health_probe: that binary is in neither PyPI nor Debian,
while grpcio-health-checking is already in the image (the `server` extra). Kubernetes
probes the same service natively (`grpc:` probes), see deploy/k8s/.

The health service is exempt from the bearer token, so this works with auth on; with
TLS on, set TOKENFEED_HEALTHCHECK_CA to the PEM that signed the server certificate (and
TOKENFEED_HEALTHCHECK_SERVER_NAME to a name in it, when that is not 127.0.0.1).
"""

from __future__ import annotations

import os
import sys


def check(
    address: str, timeout: float, ca: str | None = None, server_name: str | None = None
) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if ca:
        with open(ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(f.read())
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as e:
            print(f"unhealthy: {address}: {e.code().name}", file=sys.stderr)  # type: ignore[attr-defined]
            return False
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not ok:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        print(f"unhealthy: {address}: {name}", file=sys.stderr)
    return ok


def main(argv: list[str]) -> int:
    env = os.environ
    address = argv[1] if len(argv) > 1 else f"127.0.0.1:{env.get('TOKENFEED_PORT') or 50051}"
    timeout = float(env.get("TOKENFEED_HEALTHCHECK_TIMEOUT") or 3)
    ok = check(
        address,
        timeout,
        env.get("TOKENFEED_HEALTHCHECK_CA"),
        env.get("TOKENFEED_HEALTHCHECK_SERVER_NAME"),
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
