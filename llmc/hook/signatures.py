"""Who sent a delivery: MLflow's webhook signature and the Hugging Face Hub's shared secret header.

MLflow (3.x, `mlflow/webhooks/delivery.py`) signs `"{delivery_id}.{timestamp}.{payload}"` with HMAC-SHA256 under the
webhook's secret and sends `X-MLflow-Signature: v1,<base64 digest>` beside `X-MLflow-Delivery-Id` and
`X-MLflow-Timestamp` (Unix seconds). The payload is the request body exactly as sent. A delivery whose timestamp is
further than the tolerance from now is refused even with a valid signature: a captured request replayed later must
not start a build. The Hub sends the secret itself in `X-Webhook-Secret`; it is compared in constant time.
Pure functions: they return the reason for a refusal (None: accepted) and never include the secret in it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping

MLFLOW_SIGNATURE_HEADER = "X-MLflow-Signature"
MLFLOW_TIMESTAMP_HEADER = "X-MLflow-Timestamp"
MLFLOW_DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
MLFLOW_SIGNATURE_VERSION = "v1"
HF_SECRET_HEADER = "X-Webhook-Secret"
DEFAULT_TOLERANCE_S = 300


def mlflow_signature(secret: str, delivery_id: str, timestamp: str, payload: bytes) -> str:
    """The `X-MLflow-Signature` value MLflow sends for this delivery (`v1,<base64 HMAC-SHA256>`)."""
    signed = delivery_id.encode() + b"." + timestamp.encode() + b"." + payload
    digest = hmac.new(secret.encode("utf-8"), signed, hashlib.sha256).digest()
    return f"{MLFLOW_SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:  # plain dicts in tests and tools: headers are case-insensitive on the wire
        value = next((v for k, v in headers.items() if k.lower() == name.lower()), None)
    return value


def verify_mlflow(headers: Mapping[str, str], payload: bytes, secret: str, now: float,
                  tolerance_s: float = DEFAULT_TOLERANCE_S) -> str | None:
    """None when the delivery is MLflow's, signed with `secret`, and sent within `tolerance_s` of `now`;
    otherwise why not."""
    signature = _header(headers, MLFLOW_SIGNATURE_HEADER)
    delivery_id = _header(headers, MLFLOW_DELIVERY_ID_HEADER)
    timestamp = _header(headers, MLFLOW_TIMESTAMP_HEADER)
    if not signature or not delivery_id or not timestamp:
        missing = [h for h, v in ((MLFLOW_SIGNATURE_HEADER, signature), (MLFLOW_DELIVERY_ID_HEADER, delivery_id),
                                  (MLFLOW_TIMESTAMP_HEADER, timestamp)) if not v]
        return f"missing {', '.join(missing)}"
    if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
        return "the timestamp is not Unix seconds"
    expected = mlflow_signature(secret, delivery_id, timestamp, payload)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return "the signature does not match (another secret, or the body or headers changed)"
    age = now - int(timestamp)
    if abs(age) > tolerance_s:
        return f"the timestamp is {age:+.0f} s from now, outside the {tolerance_s:.0f} s tolerance (replayed?)"
    return None


def verify_hf(headers: Mapping[str, str], secret: str) -> str | None:
    """None when the Hub delivery carries `secret` in its X-Webhook-Secret header; otherwise why not."""
    sent = _header(headers, HF_SECRET_HEADER)
    if not sent:
        return f"missing {HF_SECRET_HEADER}"
    if not hmac.compare_digest(sent.encode(), secret.encode()):
        return f"{HF_SECRET_HEADER} does not match"
    return None
