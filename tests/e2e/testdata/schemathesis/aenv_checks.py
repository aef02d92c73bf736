"""Checks schemathesis runs against an AgentENV node (tests/e2e/schemathesis_test.go).

Every error answer has the API's error body: {"code": <the status>, "message": <text>}.
"""
import schemathesis


@schemathesis.check
def error_body_shape(ctx, response, case):
    if response.status_code < 400:
        return None
    try:
        body = response.json()
    except Exception as e:  # not JSON at all
        raise AssertionError(f"{response.status_code} answer is not JSON: {response.text[:200]!r}") from e
    if not isinstance(body, dict) or not isinstance(body.get("message"), str) or body.get("code") != response.status_code:
        raise AssertionError(f"{response.status_code} answer is not {{code, message}}: {response.text[:200]!r}")
    return None
