package api

import (
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/events"
	"github.com/agentenv/agentenv/internal/webhooks"
)

// webhooksOff answers when the node keeps no webhooks.
func (s *Server) webhooksOff(w http.ResponseWriter) bool {
	if s.cfg.Webhooks == nil {
		writeError(w, http.StatusNotFound, "this node sends no lifecycle events")
		return true
	}
	return false
}

// webhookBody is a webhook as the routes answer it (never its secret).
func webhookBody(h *webhooks.Webhook) apispec.Webhook {
	evs := make([]apispec.LifecycleEventType, len(h.Events))
	for i, e := range h.Events {
		evs[i] = apispec.LifecycleEventType(e)
	}
	signed := h.Secret != ""
	return apispec.Webhook{Id: h.ID, Name: h.Name, Url: h.URL, Enabled: h.Enabled, Events: evs, CreatedAt: h.CreatedAt, Signed: &signed}
}

func eventTypes(in *[]apispec.LifecycleEventType) *[]events.Type {
	if in == nil {
		return nil
	}
	out := make([]events.Type, len(*in))
	for i, e := range *in {
		out[i] = events.Type(e)
	}
	return &out
}

// revision is the revision the gateway gave a change of a webhook (0:
// none, or not the gateway's request).
func (s *Server) revision(r *http.Request) int64 {
	if !s.fromGateway(r) {
		return 0
	}
	rev, err := strconv.ParseInt(r.Header.Get(HeaderRevision), 10, 64)
	if err != nil || rev < 0 {
		return 0
	}
	return rev
}

// ListWebhookRecords implements GET /events/webhook-records.
func (s *Server) ListWebhookRecords(w http.ResponseWriter, r *http.Request) {
	if s.webhooksOff(w) {
		return
	}
	recs, err := s.cfg.Webhooks.Records(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	if recs == nil {
		recs = []webhooks.Record{}
	}
	writeJSON(w, http.StatusOK, recs)
}

// ApplyWebhookRecords implements POST /events/webhook-records.
func (s *Server) ApplyWebhookRecords(w http.ResponseWriter, r *http.Request) {
	if s.webhooksOff(w) || !jsonBody(w, r) {
		return
	}
	body, err := readBody(r)
	if err != nil {
		writeError(w, http.StatusRequestEntityTooLarge, err.Error())
		return
	}
	var recs []webhooks.Record
	if err := json.Unmarshal(body, &recs); err != nil {
		writeError(w, http.StatusBadRequest, "the body must be a JSON list of webhook records: "+err.Error())
		return
	}
	n, err := s.cfg.Webhooks.Apply(r.Context(), recs)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	if n > 0 {
		s.log.Info("webhooks brought up to date from the cluster", "records", n)
	}
	writeJSON(w, http.StatusOK, map[string]int{"applied": n})
}

// ListWebhooks implements GET /events/webhooks.
func (s *Server) ListWebhooks(w http.ResponseWriter, r *http.Request) {
	if s.webhooksOff(w) {
		return
	}
	l, err := s.cfg.Webhooks.List(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := make([]apispec.Webhook, 0, len(l))
	for _, h := range l {
		out = append(out, webhookBody(h))
	}
	writeJSON(w, http.StatusOK, out)
}

// CreateWebhook implements POST /events/webhooks.
func (s *Server) CreateWebhook(w http.ResponseWriter, r *http.Request) {
	if s.webhooksOff(w) || !jsonBody(w, r) {
		return
	}
	var body apispec.CreateWebhookJSONBody
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	var url *string
	if body.Url != "" {
		url = &body.Url
	}
	h, err := s.cfg.Webhooks.Create(r.Context(), webhooks.Spec{ID: body.Id, Name: body.Name, URL: url, Enabled: body.Enabled,
		Events: eventTypes(body.Events), Secret: body.SignatureSecret, Revision: s.revision(r)})
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	s.log.Info("webhook registered", "webhook", h.ID, "events", len(h.Events))
	writeJSON(w, http.StatusCreated, webhookBody(h))
}

// GetWebhook implements GET /events/webhooks/{webhookID}.
func (s *Server) GetWebhook(w http.ResponseWriter, r *http.Request, webhookID string) {
	if s.webhooksOff(w) {
		return
	}
	h, err := s.cfg.Webhooks.Get(r.Context(), webhookID)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, webhookBody(h))
}

// UpdateWebhook implements PATCH /events/webhooks/{webhookID}.
func (s *Server) UpdateWebhook(w http.ResponseWriter, r *http.Request, webhookID string) {
	if s.webhooksOff(w) || !jsonBody(w, r) {
		return
	}
	var body apispec.UpdateWebhookJSONBody
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	h, err := s.cfg.Webhooks.Update(r.Context(), webhookID, webhooks.Spec{Name: body.Name, URL: body.Url, Enabled: body.Enabled,
		Events: eventTypes(body.Events), Secret: body.SignatureSecret, Revision: s.revision(r)})
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, webhookBody(h))
}

// DeleteWebhook implements DELETE /events/webhooks/{webhookID}.
func (s *Server) DeleteWebhook(w http.ResponseWriter, r *http.Request, webhookID string) {
	if s.webhooksOff(w) {
		return
	}
	if err := s.cfg.Webhooks.Delete(r.Context(), webhookID, s.revision(r)); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// ListWebhookDeliveries implements GET /events/webhooks/{webhookID}/deliveries.
func (s *Server) ListWebhookDeliveries(w http.ResponseWriter, r *http.Request, webhookID string, params apispec.ListWebhookDeliveriesParams) {
	if s.webhooksOff(w) {
		return
	}
	limit, err := intParam("limit", params.Limit, 1, 1000, 100)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	ds, err := s.cfg.Webhooks.Deliveries(r.Context(), webhookID, limit)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := make([]apispec.WebhookDelivery, 0, len(ds))
	for _, d := range ds {
		e := apispec.WebhookDelivery{Id: d.ID, WebhookID: d.WebhookID, EventID: d.EventID, Type: apispec.LifecycleEventType(d.EventType),
			SandboxID: d.SandboxID, State: apispec.WebhookDeliveryState(d.State), Attempts: d.Attempts, CreatedAt: d.CreatedAt}
		if d.LastStatus != 0 {
			st := d.LastStatus
			e.LastStatus = &st
		}
		if d.LastError != "" {
			le := d.LastError
			e.LastError = &le
		}
		if d.State == webhooks.Pending {
			next := d.NextAt
			e.NextAttemptAt = &next
		}
		if !d.FinishedAt.IsZero() {
			f := d.FinishedAt
			e.FinishedAt = &f
		}
		out = append(out, e)
	}
	writeJSON(w, http.StatusOK, out)
}
