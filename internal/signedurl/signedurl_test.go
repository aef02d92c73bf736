package signedurl

import (
	"errors"
	"net/http/httptest"
	"net/url"
	"strconv"
	"testing"
	"time"
)

// TestCheck: the order and words of E2B's envd: a missing signature, a
// method that signs nothing, a wrong signature (also when expired), an
// expired one, a good one.
func TestCheck(t *testing.T) {
	now := time.Now()
	past, future := strconv.FormatInt(now.Add(-time.Minute).Unix(), 10), strconv.FormatInt(now.Add(time.Minute).Unix(), 10)
	for _, c := range []struct {
		name, method string
		q            url.Values
		want         error
	}{
		{"missing", "GET", url.Values{"path": {"/a"}}, ErrMissing},
		{"method", "PUT", url.Values{"path": {"/a"}, "signature": {Sign("/a", "write", "", "tok", "")}}, ErrMethod},
		{"other path", "GET", url.Values{"path": {"/b"}, "signature": {Sign("/a", "read", "", "tok", "")}}, ErrInvalid},
		{"wrong op", "POST", url.Values{"path": {"/a"}, "signature": {Sign("/a", "read", "", "tok", "")}}, ErrInvalid},
		{"wrong and expired", "GET", url.Values{"path": {"/a"}, "signature": {Sign("/a", "read", "", "other", past)}, "signature_expiration": {past}}, ErrInvalid},
		{"expired", "GET", url.Values{"path": {"/a"}, "signature": {Sign("/a", "read", "", "tok", past)}, "signature_expiration": {past}}, ErrExpired},
		{"good", "GET", url.Values{"path": {"/a"}, "signature": {Sign("/a", "read", "", "tok", future)}, "signature_expiration": {future}}, nil},
		{"good write for a user", "POST", url.Values{"path": {"/a"}, "username": {"root"}, "signature": {Sign("/a", "write", "root", "tok", "")}}, nil},
	} {
		r := httptest.NewRequest(c.method, "/files?"+c.q.Encode(), nil)
		if err := Check(r, "tok", now); !errors.Is(err, c.want) || (c.want == nil && err != nil) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
}
