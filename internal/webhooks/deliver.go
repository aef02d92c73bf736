package webhooks

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/statedb"
)

// MaxAttempts is how many times a delivery is tried before it fails.
const MaxAttempts = 6

// Headers of a delivery.
const (
	HeaderWebhookID        = "e2b-webhook-id"
	HeaderDeliveryID       = "e2b-delivery-id"
	HeaderSignatureVersion = "e2b-signature-version"
	// HeaderSignature is E2B's: the unpadded base64 SHA-256 of the secret
	// followed by the body.
	HeaderSignature = "e2b-signature"
	// HeaderHMAC is "sha256=" and the hex HMAC-SHA256 of the body keyed
	// with the secret.
	HeaderHMAC = "X-Aenv-Signature"
	// HeaderEvent is the event's type.
	HeaderEvent = "X-Aenv-Event"
)

// Sign is a delivery body's signatures with secret: E2B's and the HMAC.
func Sign(secret string, body []byte) (e2b, mac string) {
	sum := sha256.Sum256(append([]byte(secret), body...))
	m := hmac.New(sha256.New, []byte(secret))
	m.Write(body)
	return base64.RawStdEncoding.EncodeToString(sum[:]), "sha256=" + hex.EncodeToString(m.Sum(nil))
}

// DeliverOptions tune the deliverer.
type DeliverOptions struct {
	// Client sends the deliveries (default: 10 s timeout, no redirects).
	Client *http.Client
	// Backoff is the wait after the first failed try; it doubles after
	// each further one, up to a minute (default 1 s).
	Backoff time.Duration
	// Workers send at once (default 4).
	Workers int
	// Keep is how long finished deliveries are kept (default a week).
	Keep time.Duration
}

// claimFor is how long a claimed delivery is not claimed again (a try
// takes at most the client's timeout).
const claimFor = 30 * time.Second

// Run delivers the due deliveries until ctx ends.
func (s *Store) Run(ctx context.Context, opts DeliverOptions) {
	if opts.Client == nil {
		opts.Client = &http.Client{Timeout: 10 * time.Second,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	if opts.Backoff <= 0 {
		opts.Backoff = time.Second
	}
	if opts.Workers <= 0 {
		opts.Workers = 4
	}
	if opts.Keep <= 0 {
		opts.Keep = 7 * 24 * time.Hour
	}
	poll := time.NewTicker(250 * time.Millisecond)
	defer poll.Stop()
	lastPrune := time.Time{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.wake:
		case <-poll.C:
		}
		if time.Since(lastPrune) > time.Hour {
			s.prune(ctx, opts.Keep)
			s.pruneTombstones(ctx)
			lastPrune = time.Now()
		}
		due, err := s.claim(ctx, opts.Workers*4)
		if err != nil {
			if ctx.Err() == nil {
				s.log.Error("webhooks: claim due deliveries", "err", err)
			}
			continue
		}
		sem := make(chan struct{}, opts.Workers)
		var wg sync.WaitGroup
		for _, d := range due {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				s.try(ctx, opts, d)
			}()
		}
		wg.Wait()
	}
}

// claim takes up to limit due deliveries (pushing their next try past
// claimFor, so no other pass takes them meanwhile).
func (s *Store) claim(ctx context.Context, limit int) ([]*Delivery, error) {
	now := s.now().UnixMilli()
	rows, err := s.db.QueryContext(ctx, `UPDATE webhook_deliveries SET next_at = ? WHERE id IN (
		SELECT id FROM webhook_deliveries WHERE state = ? AND next_at <= ? ORDER BY next_at LIMIT ?)
		RETURNING `+deliveryColumns, now+claimFor.Milliseconds(), Pending, now, limit)
	return statedb.Collect(rows, err, scanDelivery)
}

// try sends one delivery and records how it went.
func (s *Store) try(ctx context.Context, opts DeliverOptions, d *Delivery) {
	w, err := s.Get(ctx, d.WebhookID)
	if err != nil {
		// Unregistered meanwhile: nothing to send it to.
		_, _ = s.db.ExecContext(ctx, `DELETE FROM webhook_deliveries WHERE id = ?`, d.ID)
		return
	}
	status, sendErr := send(ctx, opts.Client, w, d)
	attempts := d.Attempts + 1
	now := s.now()
	if sendErr == nil {
		_, err = s.db.ExecContext(ctx, `UPDATE webhook_deliveries SET state = ?, attempts = ?, last_status = ?, last_error = '',
			finished_at = ? WHERE id = ?`, Delivered, attempts, status, now.UnixMilli(), d.ID)
	} else if attempts >= MaxAttempts {
		_, err = s.db.ExecContext(ctx, `UPDATE webhook_deliveries SET state = ?, attempts = ?, last_status = ?, last_error = ?,
			finished_at = ? WHERE id = ?`, Failed, attempts, status, sendErr.Error(), now.UnixMilli(), d.ID)
		s.log.Warn("webhook delivery failed for good", "webhook", w.ID, "event", d.EventType, "attempts", attempts, "err", sendErr)
	} else {
		wait := min(opts.Backoff<<(attempts-1), time.Minute)
		_, err = s.db.ExecContext(ctx, `UPDATE webhook_deliveries SET attempts = ?, last_status = ?, last_error = ?, next_at = ?
			WHERE id = ?`, attempts, status, sendErr.Error(), now.Add(wait).UnixMilli(), d.ID)
	}
	if err != nil && ctx.Err() == nil {
		s.log.Error("webhooks: record a try", "delivery", d.ID, "err", err)
	}
}

// send posts a delivery; an answer other than 2xx is an error.
func send(ctx context.Context, client *http.Client, w *Webhook, d *Delivery) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.URL, bytes.NewReader(d.body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "aenv-webhooks/1")
	req.Header.Set(HeaderWebhookID, w.ID)
	req.Header.Set(HeaderDeliveryID, d.ID)
	req.Header.Set(HeaderEvent, string(d.EventType))
	if w.Secret != "" {
		e2b, mac := Sign(w.Secret, d.body)
		req.Header.Set(HeaderSignatureVersion, "v1")
		req.Header.Set(HeaderSignature, e2b)
		req.Header.Set(HeaderHMAC, mac)
	}
	resp, err := client.Do(req)
	if err != nil {
		var ue interface{ Timeout() bool }
		if errors.As(err, &ue) && ue.Timeout() {
			return 0, errors.New("the receiver did not answer in time")
		}
		return 0, fmt.Errorf("the receiver could not be reached: %v", err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode/100 != 2 {
		return resp.StatusCode, fmt.Errorf("the receiver answered %d", resp.StatusCode)
	}
	return resp.StatusCode, nil
}

// prune forgets finished deliveries older than keep.
func (s *Store) prune(ctx context.Context, keep time.Duration) {
	if _, err := s.db.ExecContext(ctx, `DELETE FROM webhook_deliveries WHERE state != ? AND finished_at < ?`,
		Pending, s.now().Add(-keep).UnixMilli()); err != nil && ctx.Err() == nil {
		s.log.Error("webhooks: prune deliveries", "err", err)
	}
}
