package gateway

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/httperr"
	"github.com/agentenv/agentenv/internal/webhooks"
)

// Each node sends the events of its own sandboxes: a webhook registered
// through the gateway is registered on every ready node under one id,
// and the webhook routes go to every node. A node that joins later does
// not have the webhooks registered before.

// createWebhook serves POST /events/webhooks.
func (g *Gateway) createWebhook(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(r)
	if err != nil {
		httperr.Write(w, http.StatusRequestEntityTooLarge, err.Error())
		return
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil || fields == nil {
		httperr.Write(w, http.StatusBadRequest, "the body must be a JSON object")
		return
	}
	if _, ok := fields["id"]; !ok {
		fields["id"], _ = json.Marshal(webhooks.NewID())
		body, _ = json.Marshal(fields)
	}
	answers, ok := g.toEveryNode(w, r, body)
	if !ok {
		return
	}
	for _, a := range answers {
		if a.status != http.StatusCreated {
			writeReply(w, a) // a refusal is the same on every node
			return
		}
	}
	writeReply(w, answers[0])
}

// listWebhooks serves GET /events/webhooks: every node's, by id.
func (g *Gateway) listWebhooks(w http.ResponseWriter, r *http.Request) {
	answers, ok := g.toEveryNode(w, r, nil)
	if !ok {
		return
	}
	out := []apispec.Webhook{}
	for _, a := range answers {
		var l []apispec.Webhook
		if a.status != http.StatusOK || json.Unmarshal(a.body, &l) != nil {
			writeReply(w, a)
			return
		}
		for _, h := range l {
			if !slices.ContainsFunc(out, func(o apispec.Webhook) bool { return o.Id == h.Id }) {
				out = append(out, h)
			}
		}
	}
	writeJSONBody(w, http.StatusOK, out)
}

// webhookOnNodes serves GET, PATCH and DELETE /events/webhooks/{id}: the
// first success of the nodes that have it, a refusal when none succeeded,
// 404 when none has it.
func (g *Gateway) webhookOnNodes(w http.ResponseWriter, r *http.Request) {
	answers, ok := g.passToEveryNode(w, r)
	if !ok {
		return
	}
	oks, refusal := splitReplies(answers)
	switch {
	case len(oks) > 0 && oks[0].status == http.StatusNoContent:
		w.WriteHeader(http.StatusNoContent)
	case len(oks) > 0:
		writeReply(w, oks[0])
	case refusal != nil:
		writeReply(w, *refusal)
	default:
		httperr.Write(w, http.StatusNotFound, fmt.Sprintf("no node has webhook %q", r.PathValue("webhookID")))
	}
}

// webhookDeliveries serves GET /events/webhooks/{id}/deliveries: every
// node's, newest first.
func (g *Gateway) webhookDeliveries(w http.ResponseWriter, r *http.Request) {
	answers, ok := g.toEveryNode(w, r, nil)
	if !ok {
		return
	}
	oks, ok := holders(w, answers, fmt.Sprintf("no node has webhook %q", r.PathValue("webhookID")))
	if !ok {
		return
	}
	lists, ok := decodeReplies[[]apispec.WebhookDelivery](g, w, oks, "a node's deliveries")
	if !ok {
		return
	}
	var out []apispec.WebhookDelivery
	for _, l := range lists {
		out = append(out, l...)
	}
	slices.SortFunc(out, func(a, b apispec.WebhookDelivery) int { return b.CreatedAt.Compare(a.CreatedAt) })
	limit := 100
	if n, err := strconv.Atoi(r.URL.Query().Get("limit")); err == nil && n > 0 {
		limit = n
	}
	if len(out) > limit {
		out = out[:limit]
	}
	if out == nil {
		out = []apispec.WebhookDelivery{}
	}
	writeJSONBody(w, http.StatusOK, out)
}
