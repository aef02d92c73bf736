// Package webhooks owns a node's webhooks: the URLs its users registered
// for sandbox lifecycle events (package events), and the delivery of
// every event to each webhook subscribed to it. A delivery is recorded in
// the node's database before it is tried, so a restart loses none; it is
// tried until the receiver answers 2xx, with growing waits between tries,
// at most MaxAttempts times; its record (attempts, last status, last
// error) is kept for a week and listed. Each delivery is signed with the
// webhook's secret: e2b-signature as E2B signs (the unpadded base64
// SHA-256 of the secret followed by the body), and X-Aenv-Signature, an
// HMAC-SHA256 of the body keyed with the secret.
package webhooks

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/events"
	"github.com/agentenv/agentenv/internal/statedb"
)

const schema = `
CREATE TABLE IF NOT EXISTS webhooks (
	id         TEXT PRIMARY KEY,
	name       TEXT NOT NULL,
	url        TEXT NOT NULL,
	enabled    INTEGER NOT NULL,
	events     TEXT NOT NULL, -- JSON list of event types
	secret     TEXT NOT NULL,
	created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS webhook_deliveries (
	id          TEXT PRIMARY KEY,
	webhook_id  TEXT NOT NULL,
	event_id    TEXT NOT NULL,
	event_type  TEXT NOT NULL,
	sandbox_id  TEXT NOT NULL,
	body        BLOB NOT NULL,
	state       TEXT NOT NULL, -- pending, delivered, failed
	attempts    INTEGER NOT NULL,
	last_status INTEGER NOT NULL,
	last_error  TEXT NOT NULL,
	next_at     INTEGER NOT NULL, -- Unix ms of the next try
	created_at  INTEGER NOT NULL,
	finished_at INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_due ON webhook_deliveries(state, next_at);
CREATE INDEX IF NOT EXISTS webhook_deliveries_of ON webhook_deliveries(webhook_id, created_at);`

// Delivery states.
const (
	Pending   = "pending"
	Delivered = "delivered"
	Failed    = "failed"
)

// Webhook is one registered webhook.
type Webhook struct {
	ID      string        `json:"id"`
	Name    string        `json:"name"`
	URL     string        `json:"url"`
	Enabled bool          `json:"enabled"`
	Events  []events.Type `json:"events"`
	// Secret signs the deliveries ("": unsigned).
	Secret    string    `json:"secret"`
	CreatedAt time.Time `json:"createdAt"`
}

// Delivery is one event's delivery to one webhook.
type Delivery struct {
	ID, WebhookID, EventID string
	EventType              events.Type
	SandboxID              string
	State                  string
	Attempts               int
	LastStatus             int
	LastError              string
	NextAt                 time.Time
	CreatedAt, FinishedAt  time.Time
	body                   []byte
}

// Store keeps the webhooks and their deliveries.
type Store struct {
	db  *sql.DB
	log *slog.Logger
	now func() time.Time
	// wake tells the deliverer that a delivery is due.
	wake chan struct{}
}

// Open creates the tables if needed.
func Open(ctx context.Context, db *sql.DB, log *slog.Logger) (*Store, error) {
	if _, err := db.ExecContext(ctx, schema); err != nil {
		return nil, fmt.Errorf("webhook tables: %w", err)
	}
	if err := migrate(ctx, db); err != nil {
		return nil, fmt.Errorf("webhook tables: %w", err)
	}
	if log == nil {
		log = slog.Default()
	}
	return &Store{db: db, log: log, now: time.Now, wake: make(chan struct{}, 1)}, nil
}

// Spec is what a webhook's registration or update gives (nil: unchanged
// on update; on registration Enabled defaults to true and Events to all).
type Spec struct {
	// ID, on registration, is the id to give the webhook (default: a new
	// one): a gateway registers one webhook on every node under one id.
	ID      *string
	Name    *string
	URL     *string
	Enabled *bool
	Events  *[]events.Type
	Secret  *string
	// Revision is the change's revision as the gateway made it (0: this
	// node's clock; see Record).
	Revision int64
}

func checkURL(raw string) error {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%w: url must be an absolute http or https URL", errkind.ErrInvalid)
	}
	if len(raw) > 2048 {
		return fmt.Errorf("%w: url longer than 2048 characters", errkind.ErrInvalid)
	}
	return nil
}

func checkEvents(ts []events.Type) error {
	if len(ts) == 0 {
		return fmt.Errorf("%w: events must name at least one event type", errkind.ErrInvalid)
	}
	for _, t := range ts {
		if !events.Known(t) {
			return fmt.Errorf("%w: unknown event type %q (known: %v)", errkind.ErrInvalid, t, events.All)
		}
	}
	return nil
}

// Create registers a webhook.
func (s *Store) Create(ctx context.Context, spec Spec) (*Webhook, error) {
	w := &Webhook{Enabled: true, Events: slices.Clone(events.All), CreatedAt: s.now().UTC().Truncate(time.Millisecond)}
	if spec.URL == nil {
		return nil, fmt.Errorf("%w: url is required", errkind.ErrInvalid)
	}
	if err := apply(w, spec); err != nil {
		return nil, err
	}
	w.ID = NewID()
	if spec.ID != nil {
		if !IDPattern.MatchString(*spec.ID) {
			return nil, fmt.Errorf("%w: webhook id %q must match %s", errkind.ErrInvalid, *spec.ID, IDPattern)
		}
		w.ID = *spec.ID
	}
	evs, _ := json.Marshal(w.Events)
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback()
	rev, err := s.nextRevision(ctx, tx, w.ID, spec.Revision)
	if err != nil {
		return nil, err
	}
	res, err := tx.ExecContext(ctx, `INSERT INTO webhooks (id, name, url, enabled, events, secret, created_at, revision)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING`,
		w.ID, w.Name, w.URL, w.Enabled, string(evs), w.Secret, w.CreatedAt.UnixMilli(), rev)
	if err != nil {
		return nil, fmt.Errorf("register webhook: %w", err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return nil, fmt.Errorf("%w: webhook %s exists", errkind.ErrConflict, w.ID)
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM webhook_tombstones WHERE id = ?`, w.ID); err != nil {
		return nil, err
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("register webhook: %w", err)
	}
	return w, nil
}

// apply checks spec and sets what it gives on w.
func apply(w *Webhook, spec Spec) error {
	if spec.Name != nil {
		if len(*spec.Name) > 256 {
			return fmt.Errorf("%w: name longer than 256 characters", errkind.ErrInvalid)
		}
		w.Name = *spec.Name
	}
	if spec.URL != nil {
		if err := checkURL(*spec.URL); err != nil {
			return err
		}
		w.URL = *spec.URL
	}
	if spec.Enabled != nil {
		w.Enabled = *spec.Enabled
	}
	if spec.Events != nil {
		if err := checkEvents(*spec.Events); err != nil {
			return err
		}
		w.Events = slices.Clone(*spec.Events)
	}
	if spec.Secret != nil {
		if len(*spec.Secret) > 1024 {
			return fmt.Errorf("%w: signatureSecret longer than 1024 characters", errkind.ErrInvalid)
		}
		w.Secret = *spec.Secret
	}
	return nil
}

// Update changes what spec gives of a webhook.
func (s *Store) Update(ctx context.Context, id string, spec Spec) (*Webhook, error) {
	w, err := s.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if err := apply(w, spec); err != nil {
		return nil, err
	}
	evs, _ := json.Marshal(w.Events)
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback()
	rev, err := s.nextRevision(ctx, tx, id, spec.Revision)
	if err != nil {
		return nil, err
	}
	res, err := tx.ExecContext(ctx, `UPDATE webhooks SET name = ?, url = ?, enabled = ?, events = ?, secret = ?, revision = ? WHERE id = ?`,
		w.Name, w.URL, w.Enabled, string(evs), w.Secret, rev, id)
	if err != nil {
		return nil, fmt.Errorf("update webhook %s: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return nil, fmt.Errorf("%w: webhook %q", errkind.ErrNotFound, id)
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("update webhook %s: %w", id, err)
	}
	return w, nil
}

// Delete unregisters a webhook at revision rev (0: this node's clock; see
// Record); its pending deliveries are dropped, its records go with it, a
// tombstone stays.
func (s *Store) Delete(ctx context.Context, id string, rev int64) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	var n int
	if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM webhooks WHERE id = ?`, id).Scan(&n); err != nil {
		return fmt.Errorf("delete webhook %s: %w", id, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: webhook %q", errkind.ErrNotFound, id)
	}
	if rev, err = s.nextRevision(ctx, tx, id, rev); err != nil {
		return err
	}
	if err := deleteIn(ctx, tx, id, rev, s.now().UnixMilli()); err != nil {
		return err
	}
	return tx.Commit()
}

const webhookColumns = `id, name, url, enabled, events, secret, created_at`

func scanWebhook(row interface{ Scan(...any) error }) (*Webhook, error) {
	var w Webhook
	var evs string
	var created int64
	if err := row.Scan(&w.ID, &w.Name, &w.URL, &w.Enabled, &evs, &w.Secret, &created); err != nil {
		return nil, err
	}
	if err := json.Unmarshal([]byte(evs), &w.Events); err != nil {
		return nil, fmt.Errorf("webhook %s events: %w", w.ID, err)
	}
	w.CreatedAt = time.UnixMilli(created).UTC()
	return &w, nil
}

// Get is one webhook (ErrNotFound when there is none).
func (s *Store) Get(ctx context.Context, id string) (*Webhook, error) {
	w, err := scanWebhook(s.db.QueryRowContext(ctx, `SELECT `+webhookColumns+` FROM webhooks WHERE id = ?`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("%w: webhook %q", errkind.ErrNotFound, id)
	}
	return w, err
}

// List is every webhook, oldest first.
func (s *Store) List(ctx context.Context) ([]*Webhook, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+webhookColumns+` FROM webhooks ORDER BY created_at, id`)
	return statedb.Collect(rows, err, scanWebhook)
}

// Emit records a delivery of ev to every enabled webhook subscribed to
// its type, and wakes the deliverer (events.Sink).
func (s *Store) Emit(ev events.Event) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	hooks, err := s.List(ctx)
	if err != nil {
		s.log.Error("webhooks: list for an event", "event", ev.Type, "err", err)
		return
	}
	body, err := json.Marshal(payload(ev))
	if err != nil {
		s.log.Error("webhooks: encode an event", "event", ev.Type, "err", err)
		return
	}
	now := s.now().UnixMilli()
	queued := 0
	for _, w := range hooks {
		if !w.Enabled || !slices.Contains(w.Events, ev.Type) {
			continue
		}
		if _, err := s.db.ExecContext(ctx, `INSERT INTO webhook_deliveries (id, webhook_id, event_id, event_type, sandbox_id, body,
			state, attempts, last_status, last_error, next_at, created_at, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, 0, 0, '', ?, ?, 0)`,
			newID("dl"), w.ID, ev.ID, string(ev.Type), ev.SandboxID, body, Pending, now, now); err != nil {
			s.log.Error("webhooks: record a delivery", "webhook", w.ID, "event", ev.Type, "err", err)
			continue
		}
		queued++
	}
	if queued > 0 {
		select {
		case s.wake <- struct{}{}:
		default:
		}
	}
}

// payload is an event as a webhook receives it: E2B's event format
// (version v2), with AgentENV's details in eventData.
func payload(ev events.Event) map[string]any {
	data := map[string]any{"sandbox_metadata": nonNil(ev.Metadata)}
	if e := ev.Execution; e != nil {
		data["execution"] = map[string]any{"started_at": e.StartedAt.UTC().Format(time.RFC3339), "vcpu_count": e.VCPUs,
			"memory_mb": e.MemoryMiB, "execution_time": e.Duration.Milliseconds()}
	}
	for k, v := range ev.Detail {
		data[k] = v
	}
	return map[string]any{
		"version": "v2", "id": ev.ID, "type": string(ev.Type), "eventData": data,
		"sandboxId": ev.SandboxID, "sandboxTemplateId": ev.TemplateID, "sandboxTeamId": "",
		"sandboxBuildId": "", "sandboxExecutionId": ev.SandboxID,
		"timestamp": ev.Time.UTC().Format(time.RFC3339Nano),
	}
}

func nonNil(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return m
}

const deliveryColumns = `id, webhook_id, event_id, event_type, sandbox_id, body, state, attempts, last_status, last_error,
	next_at, created_at, finished_at`

func scanDelivery(row interface{ Scan(...any) error }) (*Delivery, error) {
	var d Delivery
	var next, created, finished int64
	if err := row.Scan(&d.ID, &d.WebhookID, &d.EventID, &d.EventType, &d.SandboxID, &d.body, &d.State, &d.Attempts,
		&d.LastStatus, &d.LastError, &next, &created, &finished); err != nil {
		return nil, err
	}
	d.NextAt, d.CreatedAt = time.UnixMilli(next).UTC(), time.UnixMilli(created).UTC()
	if finished > 0 {
		d.FinishedAt = time.UnixMilli(finished).UTC()
	}
	return &d, nil
}

// Deliveries are a webhook's deliveries, newest first, at most limit.
func (s *Store) Deliveries(ctx context.Context, webhookID string, limit int) ([]*Delivery, error) {
	if _, err := s.Get(ctx, webhookID); err != nil {
		return nil, err
	}
	rows, err := s.db.QueryContext(ctx, `SELECT `+deliveryColumns+` FROM webhook_deliveries WHERE webhook_id = ?
		ORDER BY created_at DESC, id DESC LIMIT ?`, webhookID, limit)
	return statedb.Collect(rows, err, scanDelivery)
}

// IDPattern is what a webhook id is.
var IDPattern = regexp.MustCompile(`^wh_[a-z0-9]{1,40}$`)

// NewID is a new webhook id.
func NewID() string { return newID("wh") }

func newID(prefix string) string {
	b := make([]byte, 10)
	_, _ = rand.Read(b)
	return prefix + "_" + strings.ToLower(hex.EncodeToString(b))
}
