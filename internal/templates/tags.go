package templates

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/store"
)

// Template tags, as E2B names builds: "name:tag" is the build of template
// name that tag points at. Every build becomes the template's current one,
// its tag "default" (the template's own label); the tags a build names
// are labels of their own (kind template-tag) pointing at that build's
// layer with its settings, so a tag keeps its build when the template is
// built again, and the build's layers live while a tag reaches them.

// DefaultTag is the tag of a template's current build.
const DefaultTag = "default"

// TagRE is the form of tags.
var TagRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}$`)

// MaxTags bounds the tags one request assigns.
const MaxTags = 64

// Tag is a tag of a template.
type Tag struct {
	Tag       string
	BuildID   string
	Layer     string
	UpdatedAt time.Time
}

// BuildRef is the id of the tag's build (see Template.BuildRef).
func (t Tag) BuildRef() string { return buildRef(t.BuildID, t.Layer) }

// BuildRef is the id of the template's build: its build's, or for a
// template no build made (aenv setup, an image import) one derived from
// its root layer, so that it is a UUID like every build id.
func (t Template) BuildRef() string { return buildRef(t.BuildID, t.Layer) }

func buildRef(buildID, layer string) string {
	if buildID != "" {
		return buildID
	}
	sum := sha256.Sum256([]byte(layer))
	sum[6] = sum[6]&0x0f | 0x50 // a name-based (version 5 layout) UUID
	sum[8] = sum[8]&0x3f | 0x80
	h := hex.EncodeToString(sum[:16])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// SplitName splits "name:tag" (tag "" when there is none).
func SplitName(ref string) (name, tag string) {
	name, tag, _ = strings.Cut(ref, ":")
	return name, tag
}

// CheckTags refuses tags that are not of the form TagRE, or too many.
func CheckTags(tags []string) error {
	if len(tags) > MaxTags {
		return fmt.Errorf("%w: %d tags, at most %d", errkind.ErrInvalid, len(tags), MaxTags)
	}
	for _, t := range tags {
		if !TagRE.MatchString(t) {
			return fmt.Errorf("%w: tag %q must match %s", errkind.ErrInvalid, t, TagRE)
		}
	}
	return nil
}

// getTagged looks up name:tag. A tag at the template's current build is
// that template (its snapshot and pre-started sandboxes serve it too).
func (c *Catalog) getTagged(ctx context.Context, name, tag string) (*Template, error) {
	if !NameRE.MatchString(name) || !TagRE.MatchString(tag) {
		return nil, fmt.Errorf("%w: template %q", errkind.ErrNotFound, name+":"+tag)
	}
	cur, curErr := c.Get(ctx, name)
	if tag == DefaultTag {
		return cur, curErr
	}
	l, err := c.st.Label(ctx, store.LabelTemplateTag, name+":"+tag)
	if errors.Is(err, errkind.ErrNotFound) {
		return nil, fmt.Errorf("%w: template %q has no tag %q", errkind.ErrNotFound, name, tag)
	}
	if err != nil {
		return nil, err
	}
	t, err := c.fromLabel(ctx, l)
	if err != nil {
		return nil, err
	}
	if curErr == nil && cur.Layer == t.Layer && cur.BuildID == t.BuildID {
		return cur, nil
	}
	return t, nil
}

// SetTags points tags of template t.Name at t's build, in tx.
func SetTags(tx *sql.Tx, t Template, tags []string) error {
	if err := CheckTags(tags); err != nil {
		return err
	}
	name, _ := SplitName(t.Name)
	t.Name = name
	b, err := json.Marshal(t)
	if err != nil {
		return err
	}
	for _, tag := range tags {
		if tag == DefaultTag {
			return fmt.Errorf("%w: tag %q is the template's current build (build the template to move it)", errkind.ErrInvalid, DefaultTag)
		}
		if err := store.SetLabel(tx, store.LabelTemplateTag, name+":"+tag, t.Layer, string(b)); err != nil {
			return err
		}
	}
	return nil
}

// AssignTags points tags at the build target ("name" or "name:tag") is,
// and returns that build.
func (c *Catalog) AssignTags(ctx context.Context, target string, tags []string) (*Template, error) {
	if len(tags) == 0 {
		return nil, fmt.Errorf("%w: no tags to assign", errkind.ErrInvalid)
	}
	t, err := c.Get(ctx, target)
	if err != nil {
		return nil, err
	}
	return t, c.st.Tx(ctx, func(tx *sql.Tx) error { return SetTags(tx, *t, tags) })
}

// RemoveTags removes tags of template name; every one must exist, or none
// is removed.
func (c *Catalog) RemoveTags(ctx context.Context, name string, tags []string) error {
	if len(tags) == 0 {
		return fmt.Errorf("%w: no tags to remove", errkind.ErrInvalid)
	}
	if err := CheckTags(tags); err != nil {
		return err
	}
	if _, err := c.Get(ctx, name); err != nil {
		return err
	}
	return c.st.Tx(ctx, func(tx *sql.Tx) error {
		for _, tag := range tags {
			if tag == DefaultTag {
				return fmt.Errorf("%w: tag %q is the template's current build; delete the template instead", errkind.ErrInvalid, DefaultTag)
			}
			if err := store.DeleteLabel(tx, store.LabelTemplateTag, name+":"+tag); err != nil {
				return fmt.Errorf("%w: template %q has no tag %q", errkind.ErrNotFound, name, tag)
			}
		}
		return nil
	})
}

// Tags lists the tags of template name, "default" first.
func (c *Catalog) Tags(ctx context.Context, name string) ([]Tag, error) {
	if !NameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: template %q", errkind.ErrNotFound, name)
	}
	l, err := c.st.Label(ctx, LabelKind, name)
	if err != nil {
		return nil, err
	}
	cur, err := c.fromLabel(ctx, l)
	if err != nil {
		return nil, err
	}
	out := []Tag{{Tag: DefaultTag, BuildID: cur.BuildID, Layer: cur.Layer, UpdatedAt: l.UpdatedAt}}
	ls, err := c.st.Labels(ctx, store.LabelTemplateTag)
	if err != nil {
		return nil, err
	}
	var tagged []Tag
	for _, l := range ls {
		n, tag := SplitName(l.Name)
		if n != name {
			continue
		}
		var t Template
		if err := json.Unmarshal([]byte(l.Data), &t); err != nil {
			return nil, fmt.Errorf("%w: tag %s record: %v", errkind.ErrCorrupt, l.Name, err)
		}
		tagged = append(tagged, Tag{Tag: tag, BuildID: t.BuildID, Layer: l.Object, UpdatedAt: l.UpdatedAt})
	}
	sort.Slice(tagged, func(i, j int) bool { return tagged[i].Tag < tagged[j].Tag })
	return append(out, tagged...), nil
}
