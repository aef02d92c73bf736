package repository

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/minio/minio-go/v7"
)

// ErrNoAtomicPut: the store cannot refuse, atomically, a second Put of an
// artifact that a concurrent Put is committing (an S3-compatible server
// that ignores conditional writes). Claims that must have one winner (a
// paused sandbox taken by one node of a cluster) cannot rely on it.
var ErrNoAtomicPut = errors.New("the repository does not refuse concurrent puts of one artifact atomically")

// CheckAtomicPut reports (nil) whether r commits an artifact so that of two
// concurrent Puts of one id exactly one succeeds and the other gets
// ErrExists. posix_fs does by construction (a directory renamed into place
// refuses an existing one); on oss it depends on the server honouring
// If-None-Match on PUT, which is probed: a probe object is written twice
// with If-None-Match: *, and the second write must be refused.
func CheckAtomicPut(ctx context.Context, r Repository) error {
	switch r := r.(type) {
	case *posixFS:
		return nil
	case *ossRepo:
		return r.probeConditionalPut(ctx)
	default:
		return fmt.Errorf("%w: unknown backend %T", ErrNoAtomicPut, r)
	}
}

func (r *ossRepo) probeConditionalPut(ctx context.Context) error {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		return err
	}
	key := r.key(".probe", "conditional-put-"+hex.EncodeToString(b))
	defer r.c.RemoveObject(context.WithoutCancel(ctx), r.bucket, key, minio.RemoveObjectOptions{})
	put := func() error {
		opts := minio.PutObjectOptions{ContentType: "text/plain"}
		opts.SetMatchETagExcept("*")
		_, err := r.c.PutObject(ctx, r.bucket, key, bytes.NewReader([]byte("probe")), 5, opts)
		return err
	}
	if err := put(); err != nil {
		return fmt.Errorf("probe conditional writes: %w", err)
	}
	err := put()
	if err == nil {
		return fmt.Errorf("%w: the server accepted If-None-Match: * over an existing object", ErrNoAtomicPut)
	}
	if code := minio.ToErrorResponse(err).Code; code == "PreconditionFailed" || code == "ConditionalRequestConflict" {
		return nil
	}
	return fmt.Errorf("probe conditional writes: %w", err)
}
