package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/api"
	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/httperr"
	pb "github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb"
	"github.com/agentenv/agentenv/internal/webhooks"
)

// Each node sends the events of its own sandboxes: a webhook registered
// through the gateway is registered on every ready node under one id and
// one revision (the gateway's clock), and the webhook routes go to every
// node. Run brings a node that joins later, or was away during a change,
// to the newest record of each webhook (webhooks.Record).

// SyncEvery is how often Run compares the nodes' webhooks when the set of
// ready nodes stays the same (a change of it is looked at within
// syncPoll).
const SyncEvery = time.Minute

const syncPoll = 2 * time.Second

// Run keeps the nodes' webhooks the same until ctx ends.
func (g *Gateway) Run(ctx context.Context) {
	t := time.NewTicker(syncPoll)
	defer t.Stop()
	var synced string // the ready nodes at the last sync that succeeded
	var at time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		nodes, err := g.readyNodes(ctx)
		if err != nil {
			continue
		}
		set := nodeSet(nodes)
		if set == synced && time.Since(at) < SyncEvery {
			continue
		}
		if err := g.syncWebhooks(ctx, nodes); err != nil {
			if ctx.Err() == nil {
				g.log.Warn("gateway: bringing the nodes' webhooks up to date", "err", err)
			}
			continue
		}
		synced, at = set, time.Now()
	}
}

// nodeSet names a set of nodes (by id and URL).
func nodeSet(nodes []*pb.Node) string {
	ids := make([]string, len(nodes))
	for i, n := range nodes {
		ids[i] = n.NodeId + "=" + n.Url
	}
	slices.Sort(ids)
	return strings.Join(ids, ",")
}

// syncWebhooks sends each node the records of which another node has a
// newer revision (a tombstone wins a tie); a node that keeps no webhooks
// is left out.
func (g *Gateway) syncWebhooks(ctx context.Context, nodes []*pb.Node) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	type held struct {
		node *pb.Node
		recs map[string]webhooks.Record
	}
	var all []held
	newest := map[string]webhooks.Record{}
	for _, n := range nodes {
		status, body, err := g.nodeCall(ctx, http.MethodGet, n.Url+"/events/webhook-records", nil)
		switch {
		case err != nil:
			return fmt.Errorf("node %s: %w", n.NodeId, err)
		case status == http.StatusNotFound:
			continue // it sends no lifecycle events
		case status != http.StatusOK:
			return fmt.Errorf("node %s answered %d: %.200s", n.NodeId, status, body)
		}
		var recs []webhooks.Record
		if err := json.Unmarshal(body, &recs); err != nil {
			return fmt.Errorf("node %s's webhook records: %w", n.NodeId, err)
		}
		h := held{n, map[string]webhooks.Record{}}
		for _, r := range recs {
			h.recs[r.ID] = r
			if cur, ok := newest[r.ID]; !ok || r.Supersedes(cur) {
				newest[r.ID] = r
			}
		}
		all = append(all, h)
	}
	for _, h := range all {
		var send []webhooks.Record
		for id, r := range newest {
			// (A tombstone of a webhook it never had deletes nothing.)
			if mine, ok := h.recs[id]; (ok && r.Supersedes(mine)) || (!ok && !r.Deleted) {
				send = append(send, r)
			}
		}
		if len(send) == 0 {
			continue
		}
		body, _ := json.Marshal(send)
		status, reply, err := g.nodeCall(ctx, http.MethodPost, h.node.Url+"/events/webhook-records", body)
		if err == nil && status != http.StatusOK {
			err = fmt.Errorf("answered %d: %.200s", status, reply)
		}
		if err != nil {
			return fmt.Errorf("node %s: %w", h.node.NodeId, err)
		}
		g.log.Info("gateway: brought a node's webhooks up to date", "node", h.node.NodeId, "records", len(send))
	}
	return nil
}

// nodeCall sends the gateway's own request (not a client's) to a node.
func (g *Gateway) nodeCall(ctx context.Context, method, url string, body []byte) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	g.asGateway(req.Header, "")
	status, _, b, err := g.do(req, 64<<20)
	return status, b, err
}

// withRevision is r carrying a new revision for the change it makes on
// every node.
func withRevision(r *http.Request) *http.Request {
	r2 := r.Clone(r.Context())
	r2.Header.Set(api.HeaderRevision, strconv.FormatInt(time.Now().UnixMicro(), 10))
	return r2
}

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
	answers, ok := g.toEveryNode(w, withRevision(r), body)
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
	if r.Method != http.MethodGet {
		r = withRevision(r)
	}
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
