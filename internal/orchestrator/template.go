package orchestrator

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"
)

// Template is a bootable image sandboxes are created from (see package
// templates).
type Template = templates.Template

var templateNameRE = templates.NameRE

// Template looks a template up by name.
func (n *Node) Template(name string) (*Template, error) {
	return n.templates.Get(context.Background(), name)
}

// Catalog is the node's templates (and their tags).
func (n *Node) Catalog() *templates.Catalog { return n.templates }

// Templates lists the templates by name.
func (n *Node) Templates() ([]*Template, error) {
	return n.templates.List(context.Background())
}

// DeleteTemplate removes a template: its label, its template snapshot and
// the sandboxes pre-started from it; its layers go once nothing else
// reaches them. A template that running or paused sandboxes (or named
// snapshots) were made from is refused (ErrConflict), naming them.
func (n *Node) DeleteTemplate(ctx context.Context, name string) error {
	if _, err := n.Template(name); err != nil {
		return err
	}
	all, err := n.List(ctx)
	if err != nil {
		return err
	}
	var users []string
	for _, s := range all {
		if s.TemplateID == name {
			users = append(users, fmt.Sprintf("sandbox %s (%s)", s.ID, s.State))
		}
	}
	if named, err := n.Snapshots(); err == nil {
		for _, ns := range named {
			if ns.TemplateID == name {
				users = append(users, "snapshot "+ns.Name)
			}
		}
	}
	if len(users) > 0 {
		more := ""
		if len(users) > 5 {
			more = fmt.Sprintf(" and %d more", len(users)-5)
			users = users[:5]
		}
		return fmt.Errorf("%w: template %s is used by %s%s", ErrConflict, name, strings.Join(users, ", "), more)
	}
	if err := n.store.Tx(ctx, func(tx *sql.Tx) error {
		if err := templates.Delete(tx, name); err != nil {
			return err
		}
		if err := store.DeleteLabel(tx, templateSnapshotLabel, name); err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
		return nil
	}); err != nil {
		return err
	}
	if err := n.files.RemoveTemplate(name); err != nil {
		n.log.Warn("remove the template's build files", "template", name, "err", err)
	}
	n.drainStalePool(ctx) // its template snapshot is no template's now
	n.gc(ctx)
	n.log.Info("template deleted", "template", name)
	return nil
}

// gc removes what nothing reaches any more (see package store).
func (n *Node) gc(ctx context.Context) {
	if _, err := n.store.GC(context.WithoutCancel(ctx)); err != nil {
		n.log.Error("garbage collection", "err", err)
	}
}
