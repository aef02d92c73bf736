package repository

import (
	"encoding/json"
	"errors"
	"reflect"
	"testing"
)

// FuzzDecodeManifest: a stored manifest, however damaged, either decodes
// into one that names valid files with sane sizes and extents, or is
// refused with ErrCorrupt; it never panics. An accepted manifest survives
// an encode/decode round trip unchanged.
func FuzzDecodeManifest(f *testing.F) {
	good, _ := json.Marshal(Manifest{Format: FormatVersion, Kind: "snapshot", ID: "s1", Files: []File{
		{Name: "memory", Size: 8192, SHA256: "0000000000000000000000000000000000000000000000000000000000000000", Encoding: EncodingExtents, Extents: [][2]int64{{0, 4096}}},
		{Name: "state", Size: 3, SHA256: "1111111111111111111111111111111111111111111111111111111111111111"},
	}})
	f.Add(good)
	f.Add([]byte(`{}`))
	f.Add([]byte(`{"format":1,"kind":"snapshot","id":"s1","files":[{"name":"../x","size":1,"sha256":"00"}]}`))
	f.Add([]byte(`{"format":1,"kind":"snapshot","id":"s1","files":[{"name":"a","size":10,"sha256":"0000000000000000000000000000000000000000000000000000000000000000","encoding":"extents","extents":[[5,10]]}]}`))
	f.Add([]byte(`not json`))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := decodeManifest(data, "snapshot", "s1")
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("refusal without ErrCorrupt: %v", err)
			}
			return
		}
		for _, fe := range m.Files {
			if validFileName(fe.Name) != nil || fe.Size < 0 || !sha256HexRE.MatchString(fe.SHA256) {
				t.Fatalf("accepted a bad entry %+v", fe)
			}
			for _, e := range fe.Extents {
				if e[0] < 0 || e[1] <= 0 || e[0]+e[1] > fe.Size {
					t.Fatalf("accepted bad extents %+v", fe)
				}
			}
		}
		for i := range m.Files {
			if len(m.Files[i].Extents) == 0 {
				m.Files[i].Extents = nil // [] and absent encode alike
			}
		}
		b, err := encodeManifest(m)
		if err != nil {
			t.Fatal(err)
		}
		again, err := decodeManifest(b, "snapshot", "s1")
		if err != nil || !reflect.DeepEqual(m, again) {
			t.Fatalf("round trip: %v\n%+v\n%+v", err, m, again)
		}
	})
}
